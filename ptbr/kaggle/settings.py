"""The settings of `ptbr kaggle bundle` (its flags; defaults live here), apart from the bundle's
making so that the CLI builds its flags without importing it."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from ptbr.config import MODES
from ptbr.kaggle.layout import KAGGLE_PYTHON, STOP_AFTER_HOURS, id_problems

# --env: a variable's name, and the names a credential goes by (refused: a bundle is uploaded).
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# TOKEN, KEY and AUTH as the end of a name or of one of its _-separated parts (HF_TOKEN, API_KEY,
# APIKEY, OAUTH_CLIENT, KEYS_DIR), not inside a word (TOKENIZERS_PARALLELISM, AUTHOR).
SECRET_NAME = re.compile(r"KAGGLE|SECRET|PASSWORD|PASSWD|CREDENTIAL|AUTHORI[SZ]ATION|ACCESS_?KEY|PRIVATE_?KEY|"
                         r"(?:TOKEN|KEY|AUTH)S?(?:_|$)", re.IGNORECASE)


@dataclass(frozen=True)
class BundleSettings:
    """What `ptbr kaggle bundle` makes (the CLI's flags; defaults live here)."""

    output: str
    owner: str
    slug: str
    mode: str = "pretrain"
    data: str | None = None
    config: str | None = None
    base: str | None = None
    title: str | None = None  # the dataset's and the kernel's title (default: the slug)
    python_version: str = KAGGLE_PYTHON
    resume_from_previous: bool = False
    stop_after_hours: float = STOP_AFTER_HOURS
    env: tuple[str, ...] = ()  # NAME=VALUE for ptbr's processes in the kernel, e.g. NCCL_P2P_DISABLE=1

    @property
    def id(self) -> str:
        return f"{self.owner}/{self.slug}"

    def problems(self) -> list[str]:
        found = id_problems(self.owner, self.slug, self.title)
        # "" is no path (Path("") is the current directory, and an empty --data would mean the sample)
        for flag, value in (("--output", self.output), ("--data", self.data), ("--config", self.config),
                            ("--base", self.base)):
            if value == "":
                found.append(f"{flag} must be a path, got an empty one")
        if self.mode not in MODES:
            found.append(f"--mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if not re.match(r"^3\.\d+$", self.python_version or ""):
            found.append(f"--python-version must be a CPython version such as {KAGGLE_PYTHON}, got "
                         f"{self.python_version!r}")
        elif int(self.python_version.split(".")[1]) < 10:  # pyproject.toml's requires-python
            found.append(f"--python-version {self.python_version}: ptbr needs Python 3.10 or newer (Kaggle's image "
                         f"has {KAGGLE_PYTHON})")
        if not (isinstance(self.stop_after_hours, (int, float)) and math.isfinite(self.stop_after_hours)
                and 0 < self.stop_after_hours <= 12):
            found.append(f"--stop-after-hours must be within (0, 12] (Kaggle's GPU sessions end after 12 h), got "
                         f"{self.stop_after_hours!r}")
        if self.mode == "pretrain" and self.base:
            found.append("--base is for --mode finetune")
        for setting in self.env:
            name = setting.split("=", 1)[0]
            if "=" not in setting or not ENV_NAME.match(name):
                found.append(f"--env {setting!r} is not NAME=VALUE")
            elif SECRET_NAME.search(name):
                found.append(f"--env {name}: a bundle holds no credentials (the kernel needs none)")
        names = [setting.split("=", 1)[0] for setting in self.env if "=" in setting]
        found += [f"--env {name} is given {names.count(name)} times: give it once" for name in sorted(set(names))
                  if names.count(name) > 1]
        return found

    def environment(self) -> dict[str, str]:
        return dict(setting.split("=", 1) for setting in self.env)
