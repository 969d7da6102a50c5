"""`ptbr kaggle bundle|push|status|output`."""

from __future__ import annotations

import math

from ptbr.errors import ConfigError

MAX_POLL_SECONDS = 86400  # asking Kaggle less often than daily is no wait


def main(args) -> int:
    if args.kaggle_action == "bundle":
        from ptbr.kaggle.bundle import make_bundle
        from ptbr.kaggle.settings import BundleSettings

        make_bundle(BundleSettings(
            output=args.output, owner=args.owner, slug=args.slug, mode=args.mode, data=args.data, config=args.config,
            base=args.base, title=args.title, python_version=args.python_version,
            resume_from_previous=args.resume_from_previous, stop_after_hours=args.stop_after_hours,
            env=tuple(args.env or ())))
        return 0

    from ptbr.kaggle import remote

    poll = getattr(args, "poll_seconds", None)
    if poll is not None and not (math.isfinite(poll) and 0 < poll <= MAX_POLL_SECONDS):
        raise ConfigError(f"--poll-seconds must be > 0 and at most {MAX_POLL_SECONDS} (a day), got {poll:g}",
                          f"ptbr kaggle {args.kaggle_action}", "give a number of seconds")
    waiting = remote.Waiting(poll_s=poll) if poll is not None else remote.Waiting()
    if args.kaggle_action == "push":
        remote.push(args.bundle, kernel_only=args.kernel_only, waiting=waiting)
    elif args.kaggle_action == "status":
        remote.status(args.bundle, wait=args.wait, waiting=waiting)
    elif args.kaggle_action == "output":
        remote.output(args.bundle, args.path, args.pattern, waiting=waiting)
    return 0
