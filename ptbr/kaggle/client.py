"""The Kaggle API client (the `kaggle` package), imported here only, when a command talks to Kaggle,
and what its failures mean to a user: one ptbr error each, never its help text or its exit(1).

Where the client looks for credentials, in its order: KAGGLE_API_TOKEN (the token, or a file holding
it), ~/.kaggle/access_token; one kaggle.json (in $KAGGLE_CONFIG_DIR where that is set, else ~/.kaggle
or ~/.config/kaggle), or KAGGLE_USERNAME and KAGGLE_KEY; the login `kaggle auth login` saved. No
credential is ever printed, logged or written by ptbr.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ptbr.errors import ConfigError, KaggleError
from ptbr.log import log

HOW_TO_GET_ONE = ("create an API token at https://www.kaggle.com/settings/api (\"Generate New Token\") and save it "
                  "to ~/.kaggle/access_token (chmod 600), or export KAGGLE_API_TOKEN=...")
KAGGLE_JSON_FIX = ('write it as {"username": "YOUR_NAME", "key": "YOUR_KEY"} (the file Kaggle\'s "Create Legacy API '
                   'Key" gives), or ' + HOW_TO_GET_ONE)
RETRY_LATER = ("the failure is on Kaggle's side: run the command again in a few minutes (see https://status.kaggle.com "
               "if it lasts)")


class KaggleUnavailable(KaggleError):
    """Kaggle failed on its side (HTTP 5xx), limited the rate of requests (429) or did not answer:
    the same request may succeed a little later (a wait of hours asks again)."""


def where_kaggle_looks(api) -> str:
    """The places the client takes credentials from, its kaggle.json the one file it reads."""
    moved = " ($KAGGLE_CONFIG_DIR)" if os.environ.get("KAGGLE_CONFIG_DIR") else ""
    return (f"KAGGLE_API_TOKEN (a token, or a file holding it), ~/.kaggle/access_token, {api.config}{moved}, "
            "KAGGLE_USERNAME and KAGGLE_KEY, or the login `kaggle auth login` saved")


def connect(timeout_s: float):
    """An authenticated KaggleApi whose every API request gives up after `timeout_s`. Missing or
    refused credentials are a ConfigError (exit 2): the fix is on this machine."""
    printed = io.StringIO()
    # `import kaggle` authenticates at import time and prints a help text when it finds no credentials.
    with contextlib.redirect_stdout(printed):
        try:
            from kaggle.api.kaggle_api_extended import KaggleApi
        except ImportError as exc:
            raise ConfigError(f"the kaggle package is not installed ({exc})", "ptbr kaggle",
                              "pip install 'ptbr[kaggle]' (or run `nox -s kaggle -- ...`)") from exc
        import requests  # (the kaggle client's own dependency)

        api = KaggleApi()
        # VERBOSE=1 in the environment makes the client print every request with its Authorization
        # header: this instance never does.
        api.args = [arg for arg in api.args if arg != "--verbose"]
        limit_requests(api, timeout_s)
        config = Path(api.config)
        if not_an_object(config):
            raise ConfigError(f"{config} is not usable: {NEEDS_KEYS}", "ptbr kaggle", KAGGLE_JSON_FIX)
        try:
            api.authenticate()
        except SystemExit as exc:  # the client's exit(1) when it finds nothing it can use
            token = token_source()
            problem = None if token else kaggle_json_problem(config)
            if problem is not None:
                raise ConfigError(f"{config} is not usable: {problem}", "ptbr kaggle", KAGGLE_JSON_FIX) from exc
            what = (f"Kaggle did not accept the token in {token}" if token else
                    "no Kaggle credentials found")
            raise ConfigError(f"{what} (Kaggle looks in {where_kaggle_looks(api)})", "ptbr kaggle",
                              HOW_TO_GET_ONE) from exc
        except requests.RequestException as exc:  # a token is checked over the network
            raise request_failed(api, "check the credentials with Kaggle", exc) from exc
    # the client reads its settings at import and again here: each warning once (e.g. a kaggle.json
    # that other users can read)
    for line in dict.fromkeys(printed.getvalue().splitlines()):
        if line.startswith("Warning"):
            log(line)
    return api


def limit_requests(api, timeout_s: float) -> None:
    """Every request of `api`'s API calls gives up after timeout_s: the client sets no timeout, so a
    Kaggle that never answers would hang a command silently. (Uploads go through sessions of their
    own, and ptbr's downloads set their own timeout.)"""
    import requests

    class TimedAdapter(requests.adapters.HTTPAdapter):
        def send(self, request, timeout=None, **kwargs):
            return super().send(request, timeout=timeout_s if timeout is None else timeout, **kwargs)

    build = api.build_kaggle_client

    def build_timed():
        client = build()
        http = client.http_client()
        http._init_session()  # the session every call goes through (the client makes it on first use)
        for prefix in ("http://", "https://"):
            http._session.mount(prefix, TimedAdapter())
        return client

    api.build_kaggle_client = build_timed
    api.ptbr_timeout_s = timeout_s


NEEDS_KEYS = 'it needs "username" and "key"'


def not_an_object(path: Path) -> bool:
    """The kaggle.json the client reads holds JSON other than an object ([1, 2], a number): the
    client fails on it with a TypeError of its own, whatever other credentials there are."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return bool(value) and not isinstance(value, dict)


def kaggle_json_problem(path: Path) -> str | None:
    """Why the kaggle.json the client reads cannot be used (not JSON, no username or key), or None
    (also where there is none): the client then says it found no credentials at all."""
    if not path.is_file():
        return None
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        return f"not valid JSON ({first_line(exc)})"
    if not isinstance(value, dict) or not value.get("username") or not value.get("key"):
        return NEEDS_KEYS
    return None


def token_source() -> str | None:
    """Where the client finds a token, if it finds one (the token itself is not read)."""
    if os.environ.get("KAGGLE_API_TOKEN"):
        return "KAGGLE_API_TOKEN"
    for name in ("access_token", "access_token.txt"):
        if (Path.home() / ".kaggle" / name).is_file():
            return f"~/.kaggle/{name}"
    return None


def credentials_sent(api, request) -> str:
    """Which credentials a request carried. The client sends a token it finds whenever there is one,
    even one that Kaggle did not accept when it authenticated and a key that it then used instead."""
    method = str(api.config_values.get("auth_method", ""))
    sent = str(getattr(request, "headers", {}).get("Authorization", ""))
    if sent.startswith("Bearer") or (not sent and "ACCESS_TOKEN" in method):
        if "OAUTH" in method:
            return "the login `kaggle auth login` saved"
        return f"the token in {token_source()}" if token_source() else "an access token"
    if os.environ.get("KAGGLE_USERNAME") and os.environ.get("KAGGLE_KEY"):
        return "KAGGLE_USERNAME and KAGGLE_KEY"
    return str(api.config)


def username(api) -> str | None:
    return api.config_values.get("username")


def call(api, what: str, function: Callable[..., Any], *args, absent_ok: bool = False, **kwargs) -> Any:
    """function(*args, **kwargs) with the client's failures as one error each: refused credentials
    (HTTP 401) are exit 2, anything else Kaggle refuses or fails (an HTTP error, no answer, the
    client's own checks) exit 11, with Kaggle's message. With absent_ok, a 404 (no such dataset or
    kernel yet) returns None."""
    import requests

    try:
        return function(*args, **kwargs)
    except (requests.HTTPError, ValueError) as exc:
        # the client turns some HTTP errors into a ValueError of its own (kernels_status: 401 and 403),
        # whose text is not about this request: Kaggle's answer is in the HTTPError it replaced
        http = exc if isinstance(exc, requests.HTTPError) else exc.__context__
        if not isinstance(http, requests.HTTPError):  # the client's own checks of metadata and ids
            raise KaggleError(f"cannot {what}: {first_line(exc)}", "Kaggle client",
                              "check the bundle's owner and slug (make the bundle again to change them)") from exc
        if getattr(http.response, "status_code", None) == 404 and absent_ok:
            return None
        raise request_failed(api, what, http) from exc
    except requests.RequestException as exc:
        raise request_failed(api, what, exc) from exc


def request_failed(api, what: str, exc) -> KaggleError | ConfigError:
    """The error for a request that failed: refused credentials (401), Kaggle's failure (5xx), its
    rate limit (429) or no answer (KaggleUnavailable: asking again later may work), any other refusal."""
    import requests

    if isinstance(exc, requests.Timeout):
        limit = getattr(api, "ptbr_timeout_s", None)
        within = f" within {limit:g} s" if limit else ""
        return KaggleUnavailable(f"cannot {what}: Kaggle did not answer{within}", "Kaggle API",
                                 "check the network (and https://status.kaggle.com), then run the command again")
    response = getattr(exc, "response", None)
    status = getattr(response, "status_code", None)
    if not isinstance(exc, requests.HTTPError) or status is None:
        return KaggleUnavailable(f"cannot {what}: Kaggle did not answer ({first_line(exc)})", "Kaggle API",
                                 "check the network, then run the command again")
    if status == 401:
        sent = credentials_sent(api, response.request)
        fix = HOW_TO_GET_ONE
        if sent.startswith("the token") and "ACCESS_TOKEN" not in str(api.config_values.get("auth_method", "")):
            fix = (f"remove or replace {token_source()}: the client sends a token wherever it finds one, before "
                   f"kaggle.json or KAGGLE_KEY, even one Kaggle did not accept; to replace it, {HOW_TO_GET_ONE}")
        return ConfigError(f"Kaggle refused the credentials from {sent} (HTTP 401) while trying to {what}",
                           "ptbr kaggle", fix)
    if status == 429:
        return KaggleUnavailable(f"cannot {what}: Kaggle answered {http_message(exc)}", "Kaggle API",
                                 "Kaggle is limiting the rate of requests: wait a few minutes, then run the command "
                                 "again")
    if status >= 500:
        return KaggleUnavailable(f"cannot {what}: Kaggle answered {http_message(exc)}", "Kaggle API", RETRY_LATER)
    return KaggleError(f"cannot {what}: Kaggle answered {http_message(exc)}", "Kaggle API",
                       "check the bundle's owner and slug, and that your account may do this")


def http_message(exc) -> str:
    response = exc.response
    detail = ""
    if response is not None:
        try:
            body = response.json()
            detail = str(body.get("message") or body.get("error") or "") if isinstance(body, dict) else ""
        except ValueError:
            detail = response.text.strip()[:200]
    status = f"HTTP {response.status_code}" if response is not None else "an error"
    return f"{status}: {detail or first_line(exc)}"


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
