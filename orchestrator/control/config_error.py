"""The error of settings that contradict each other, in a module of its own: the client commands import it
(through the config file's parser) and must not load the serving code that control/options.py brings."""


class ConfigError(ValueError):
    """A config file (or a command line) that sets something wrongly; the message names the key. In control,
    below the command line that reads the file, because attached endpoints' settings are checked here."""
