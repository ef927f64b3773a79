"""The command line's own checks, made before torch is imported (by ``nsa-train``) and again by
the torchrun entry point: options are ``--section.field`` and the config file is valid TOML; and
the dump folder a run would use, read from the flags and the TOML alone."""

import os
import re
import tomllib

from .usage import flavor_names


def check_config_file(args: list[str]) -> None:
    """The --job.config_file exists and is valid TOML (torchtitan would log a traceback)."""
    paths = [a.split("=", 1)[1] if "=" in a else (args[i + 1] if i + 1 < len(args) else "")
             for i, a in enumerate(args) if a.split("=", 1)[0] in ("--job.config_file", "--job.config-file")]
    if len(paths) > 1:  # torchtitan reads the first one only
        raise ValueError(f"--job.config_file given {len(paths)} times ({', '.join(map(repr, paths))}): give one "
                         "config file, and change its values with --section.field options")
    if not paths:
        return
    path = paths[0]
    if not os.path.isfile(path):
        raise ValueError(f"--job.config_file {path!r} does not exist")
    try:
        with open(path, "rb") as f:
            tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"config file {path!r}: TOML syntax error: {e}") from None


def check_flags(args: list[str]) -> None:
    """Every option is ``--section.field`` (or one of nsa-train's own) and no value comes before the
    first option: reported before torch is imported (the field names themselves are checked by
    torchtitan's parser)."""
    own = ("--preflight", "--preflight-full", "--help-all")
    if args and not args[0].startswith("-"):
        raise ValueError(f"unexpected argument {args[0]!r}: values follow an option (--SECTION.FIELD VALUE); "
                         "see nsa-train --help")
    for a in args:
        name = a.split("=", 1)[0]
        if re.fullmatch(r"-\d[\d.]*(e-?\d+)?|-\.\d+|-inf", a):  # a negative value
            continue
        if a.startswith("-") and name not in own and not re.fullmatch(r"--[A-Za-z_][\w-]*\.[A-Za-z_][\w.-]*", name):
            raise ValueError(f"unknown option {name!r}: options are --SECTION.FIELD VALUE (e.g. --training.steps "
                             "100), --preflight, --preflight-full; see nsa-train --help")


def _flag_value(args: list[str], *names: str) -> str | None:
    """The value of the last of the flags ``names`` in ``args`` (``--flag value`` or ``--flag=value``)."""
    value = None
    for i, a in enumerate(args):
        name, eq, rest = a.partition("=")
        if name in names:
            value = rest if eq else (args[i + 1] if i + 1 < len(args) else None)
    return value


def _setting(args: list[str], section: str, field: str):
    """``[section] field`` as the flags (``_`` or ``-``) or else the config file set it; None when
    neither does."""
    flag = _flag_value(args, f"--{section}.{field}", f"--{section}.{field.replace('_', '-')}")
    if flag is not None:
        return flag
    path = _flag_value(args, "--job.config_file", "--job.config-file")
    if not path or not os.path.isfile(path):
        return None
    with open(path, "rb") as f:
        return tomllib.load(f).get(section, {}).get(field)


def dump_folder(args: list[str]) -> str | None:
    """The run's ``[job] dump_folder``: the flag's, else the config file's; None when neither says
    (torchtitan's default then applies, known only once torchtitan is imported)."""
    return _setting(args, "job", "dump_folder")


def unknown_flavor(name: str) -> str | None:
    """The one-line message for a ``[model] flavor`` that nsa_flex lacks; None when it exists."""
    names = flavor_names()
    if name in names:
        return None
    return f"[model] flavor={name!r}: unknown nsa_flex flavor; allowed values are {sorted(names)}"


def check_flavor(args: list[str]) -> None:
    """The nsa_flex model's flavor, from the flags or the config file, exists (before torch)."""
    flavor = _setting(args, "model", "flavor")
    if _setting(args, "model", "name") in (None, "nsa_flex") and flavor is not None and unknown_flavor(flavor):
        raise ValueError(unknown_flavor(flavor))
