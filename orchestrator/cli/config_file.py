"""Settings from a YAML file (`--config FILE`), checked by the same argparse actions as the flags.

A command's full list of settings is one argparse parser (`settings`); its command line shows
only some of them. Every key of the file names one of those settings by its long flag without
the dashes (`target-dtype`, or `target_dtype`), and its value goes through that setting's own
`type` and `choices`, so a value means the same in the file as it would as a flag. The command
line wins over the file, and the file over the defaults.
"""

from __future__ import annotations

import argparse
import difflib
import json
from pathlib import Path

import yaml

from orchestrator.control.config_error import ConfigError


class ConfigurableParser(argparse.ArgumentParser):
    """A subcommand parser that, once `accept_config_file` is called on it, reads `--config FILE`.

    The merge happens in parse_known_args because argparse's subcommand action calls exactly that
    on the subcommand's parser: `build_parser().parse_args(["serve", "--config", f])` then returns
    every setting, from the file where the command line did not give it.
    """

    settings: argparse.ArgumentParser | None = None

    def accept_config_file(self, settings: argparse.ArgumentParser, help: str) -> None:
        self.settings = settings
        self.add_argument("--config", metavar="FILE", default=None, help=help)

    def parse_known_args(self, args=None, namespace=None):
        if self.settings is None:
            return super().parse_known_args(args, namespace)
        args = list(args) if args is not None else []
        namespace = namespace if namespace is not None else argparse.Namespace()
        settings = vars(self.settings.parse_args([]))  # the defaults, converted as argparse converts them
        config_path = _config_path(args)
        if config_path is not None:
            settings.update(load_config(config_path, self.settings))
        for dest, value in settings.items():
            if not hasattr(namespace, dest):
                setattr(namespace, dest, value)
        # argparse fills in a default only where the namespace has no value: the file's values stay
        # unless the command line gives the flag.
        namespace, extras = super().parse_known_args(args, namespace)
        _refuse_file_only_flags(extras, self.settings, self.prog)
        return namespace, extras


def load_config(path: str, settings: argparse.ArgumentParser) -> dict[str, object]:
    """{dest: converted value} for every key of the YAML file at `path`; ConfigError names a bad key."""
    try:
        data = yaml.safe_load(Path(path).read_text())
    except OSError as error:
        raise ConfigError(f"{path}: cannot read: {error.strerror or error}") from None
    except yaml.YAMLError as error:
        raise ConfigError(f"{path}: not YAML: {' '.join(str(error).split())}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of setting names to values, not {type(data).__name__}")
    actions = settings_by_key(settings)
    values: dict[str, object] = {}
    for key, value in data.items():
        name = str(key).replace("_", "-")
        action = actions.get(name)
        if action is None:
            close = difflib.get_close_matches(name, actions, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else " (docs/configuration.md lists the keys)"
            raise ConfigError(f"{path}: unknown key {key!r}{hint}")
        if action.dest in values:
            raise ConfigError(f"{path}: key {key!r} is given twice (with dashes and with underscores)")
        values[action.dest] = convert(action, value, f"{path}: key {key!r}")
    return values


def settings_by_key(settings: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """Each setting's action by its config key: the long flag without its dashes."""
    keys = {}
    for action in settings._actions:  # argparse keeps no public list of a parser's actions
        for option in action.option_strings:
            if option.startswith("--") and option != "--help":
                keys[option[2:]] = action
    return keys


def convert(action: argparse.Action, value: object, where: str) -> object:
    """The value as the flag would have produced it, through the action's own type and choices."""
    if action.nargs == 0:  # store_true: the flag's presence
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true or false, not {value!r}")
        return value
    if value is None:
        return action.default
    text = _as_text(value, action, where)
    try:
        result = action.type(text) if action.type is not None else text
    except (argparse.ArgumentTypeError, ValueError, TypeError) as error:
        raise ConfigError(f"{where}: {value!r} is not valid: {error}") from None
    if action.choices is not None and result not in action.choices:
        choices = ", ".join(map(str, action.choices))
        raise ConfigError(f"{where}: {value!r} is not one of {choices}")
    return result


def _as_text(value: object, action: argparse.Action, where: str) -> str:
    """The command-line text of a YAML value."""
    if isinstance(value, bool):
        # YAML 1.1 reads on/off and yes/no as booleans: `pipeline: on` means the choice "on".
        if action.choices is not None and {"on", "off"} <= set(action.choices):
            return "on" if value else "off"
        raise ConfigError(f"{where}: expected a value, not {str(value).lower()}")
    if isinstance(value, (dict, list)):
        if action.type is None:  # a plain text setting: a mapping or list is a mistake, not text
            raise ConfigError(f"{where}: expected one value, not a {'mapping' if isinstance(value, dict) else 'list'}")
        # A JSON setting (Ray resources) takes a mapping; a CPU list takes a list of cores.
        return json.dumps(value) if isinstance(value, dict) else ",".join(map(str, value))
    return str(value)


def _config_path(args: list[str]) -> str | None:
    finder = argparse.ArgumentParser(add_help=False)
    finder.add_argument("--config", default=None)
    return finder.parse_known_args(args)[0].config


def _refuse_file_only_flags(extras: list[str], settings: argparse.ArgumentParser, prog: str) -> None:
    """A setting's flag that only the file may give: say where it goes instead of 'unrecognized'."""
    keys = settings_by_key(settings)
    for extra in extras:
        key = extra.split("=", 1)[0].removeprefix("--")
        if extra.startswith("--") and key in keys:
            raise ConfigError(f"{extra.split('=', 1)[0]} is a config file setting: write '{key}: VALUE' in the "
                              f"--config FILE of `{prog}` (docs/configuration.md)")
