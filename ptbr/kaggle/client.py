"""The Kaggle API client (the `kaggle` package), imported here only, when a command talks to Kaggle,
and what its failures mean to a user: one ptbr error each, never its help text or its exit(1).

Where the client looks for credentials, in its order: KAGGLE_API_TOKEN (the token, or a file holding
it), ~/.kaggle/access_token; kaggle.json in $KAGGLE_CONFIG_DIR, ~/.kaggle or ~/.config/kaggle, or
KAGGLE_USERNAME and KAGGLE_KEY; the login `kaggle auth login` saved. No credential is ever printed,
logged or written by ptbr.
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

WHERE_KAGGLE_LOOKS = ("KAGGLE_API_TOKEN (a token, or a file holding it), ~/.kaggle/access_token, kaggle.json in "
                      "$KAGGLE_CONFIG_DIR, ~/.kaggle or ~/.config/kaggle, KAGGLE_USERNAME and KAGGLE_KEY, or the "
                      "login `kaggle auth login` saved")
HOW_TO_GET_ONE = ("create an API token at https://www.kaggle.com/settings/api (\"Generate New Token\") and save it "
                  "to ~/.kaggle/access_token (chmod 600), or export KAGGLE_API_TOKEN=...")


def connect():
    """An authenticated KaggleApi. Missing or refused credentials are a ConfigError (exit 2): the fix is
    on this machine."""
    printed = io.StringIO()
    # `import kaggle` authenticates at import time and prints a help text when it finds no credentials.
    with contextlib.redirect_stdout(printed):
        try:
            from kaggle.api.kaggle_api_extended import KaggleApi
        except ImportError as exc:
            raise ConfigError(f"the kaggle package is not installed ({exc})", "ptbr kaggle",
                              "pip install 'ptbr[kaggle]' (or run `nox -s kaggle -- ...`)") from exc
        api = KaggleApi()
        # VERBOSE=1 in the environment makes the client print every request with its Authorization
        # header: this instance never does.
        api.args = [arg for arg in api.args if arg != "--verbose"]
        try:
            api.authenticate()
        except SystemExit as exc:  # the client's exit(1) when it finds nothing it can use
            token = token_source()
            broken = None if token else broken_kaggle_json()
            if broken is not None:
                raise ConfigError(f"{broken[0]} is not usable: {broken[1]}", "ptbr kaggle",
                                  'write it as {"username": "YOUR_NAME", "key": "YOUR_KEY"} (the file Kaggle\'s '
                                  '"Create Legacy API Key" gives), or ' + HOW_TO_GET_ONE) from exc
            what = (f"Kaggle did not accept the token in {token}" if token else
                    "no Kaggle credentials found")
            raise ConfigError(f"{what} (Kaggle looks in {WHERE_KAGGLE_LOOKS})", "ptbr kaggle", HOW_TO_GET_ONE) from exc
        except Exception as exc:  # noqa: BLE001 - a token is checked over the network
            raise KaggleError(f"cannot reach Kaggle to check the credentials: {first_line(exc)}", "ptbr kaggle",
                              "check the network") from exc
    for line in printed.getvalue().splitlines():
        if line.startswith("Warning"):  # e.g. a kaggle.json that other users can read
            log(line)
    return api


def broken_kaggle_json() -> tuple[Path, str] | None:
    """The first kaggle.json where the client looks that it cannot use (not JSON, no username or key):
    the client then says it found no credentials at all."""
    folders = [Path(os.environ["KAGGLE_CONFIG_DIR"])] if os.environ.get("KAGGLE_CONFIG_DIR") else []
    folders += [Path.home() / ".kaggle", Path.home() / ".config" / "kaggle"]
    for folder in folders:
        path = folder / "kaggle.json"
        if not path.is_file():
            continue
        try:
            value = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            return path, f"not valid JSON ({first_line(exc)})"
        if not isinstance(value, dict) or not value.get("username") or not value.get("key"):
            return path, 'it needs "username" and "key"'
        return None
    return None


def token_source() -> str | None:
    """Where the client found a token, if it found one (the token itself is not read)."""
    if os.environ.get("KAGGLE_API_TOKEN"):
        return "KAGGLE_API_TOKEN"
    for name in ("access_token", "access_token.txt"):
        if (Path.home() / ".kaggle" / name).is_file():
            return f"~/.kaggle/{name}"
    return None


def credentials_source(api) -> str:
    """Which of the places Kaggle looks in gave the credentials in use."""
    method = str(api.config_values.get("auth_method", ""))
    if "ACCESS_TOKEN" in method:
        return token_source() or "an access token"
    if "OAUTH" in method:
        return "the login `kaggle auth login` saved"
    if os.environ.get("KAGGLE_USERNAME") and os.environ.get("KAGGLE_KEY"):
        return "KAGGLE_USERNAME and KAGGLE_KEY"
    return str(api.config)


def username(api) -> str | None:
    return api.config_values.get("username")


def call(api, what: str, function: Callable[..., Any], *args, absent_ok: bool = False, **kwargs) -> Any:
    """function(*args, **kwargs) with the client's failures as one error each: refused credentials
    (HTTP 401) are exit 2, anything else Kaggle refuses or fails (an HTTP error, no connection, the
    client's own checks) exit 11, with Kaggle's message. With absent_ok, a 404 (no such dataset or
    kernel yet) returns None."""
    import requests

    try:
        return function(*args, **kwargs)
    except (requests.HTTPError, ValueError) as exc:
        # the client turns some HTTP errors into a ValueError of its own (kernels_status: 401 and 403)
        http = exc if isinstance(exc, requests.HTTPError) else exc.__context__
        status = getattr(getattr(http, "response", None), "status_code", None)
        if status == 404 and absent_ok:
            return None
        if status == 401:
            raise ConfigError(f"Kaggle refused the credentials from {credentials_source(api)} (HTTP 401) while "
                              f"trying to {what}", "ptbr kaggle", HOW_TO_GET_ONE) from exc
        if not isinstance(exc, requests.HTTPError):  # the client's own checks of metadata and ids
            raise KaggleError(f"cannot {what}: {first_line(exc)}", "Kaggle client",
                              "check the bundle's owner and slug (make the bundle again to change them)") from exc
        if status is not None and status >= 500:
            raise KaggleError(f"cannot {what}: Kaggle answered {http_message(exc)}", "Kaggle API",
                              "the failure is on Kaggle's side: run the command again in a few minutes (see "
                              "https://status.kaggle.com if it lasts)") from exc
        raise KaggleError(f"cannot {what}: Kaggle answered {http_message(exc)}", "Kaggle API",
                          "check the bundle's owner and slug, and that your account may do this") from exc
    except requests.RequestException as exc:
        raise KaggleError(f"cannot {what}: Kaggle did not answer ({first_line(exc)})", "Kaggle API",
                          "check the network, then run the command again") from exc


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
