"""The command line's argument parser: every usage error is one line with a hint.

argparse prints the top-level usage for a mistake made inside a subcommand
(``appliance serve --port 1``) and a traceback for values that pass its type but not
the socket layer (``--http-port 70000``). Here a mistake is one line naming the
subcommand, what was wrong and, for an unknown option, the nearest known one.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, NoReturn

_UNRECOGNIZED = "unrecognized arguments: "


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line (exit status 2)."""

    def parse_args(self, args: Any = None, namespace: Any = None) -> Any:
        self._words = list(sys.argv[1:] if args is None else args)
        return super().parse_args(args, namespace)

    def _options(self) -> list[tuple[str, str]]:
        """(option, prog of the parser that has it): the subcommand named on the command
        line if there is one, else this parser's and every subcommand's."""
        words = getattr(self, "_words", [])
        found = [(o, self.prog) for action in self._actions for o in action.option_strings]
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                named = [action.choices[w] for w in words if w in action.choices]
                for sub in named[:1] or list(action.choices.values()):
                    found += [(o, sub.prog) for a in sub._actions for o in a.option_strings]
        return found

    def _named_prog(self) -> str:
        """The prog of the subcommand named on the command line, else this parser's."""
        words = getattr(self, "_words", [])
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                for w in words:
                    if w in action.choices:
                        return str(action.choices[w].prog)
        return self.prog

    def error(self, message: str) -> NoReturn:
        prog = self._named_prog()
        if message.startswith(_UNRECOGNIZED):
            import difflib  # (only for a wrong command line: not on every start)

            options = dict(reversed(self._options()))  # an option's first owner wins
            unknown = [w for w in message[len(_UNRECOGNIZED) :].split() if w.startswith("-")]
            for word in unknown:
                near = difflib.get_close_matches(word.split("=")[0], list(options), n=1)
                if near:
                    message += f" (did you mean {near[0]}?)"
                    prog = options[near[0]]
                    break
        sys.stderr.write(f"{self.prog}: error: {message} (see {prog} --help)\n")
        sys.exit(2)


def port(text: str) -> int:
    """A TCP port for a listener: 0 (any free port), 1..65535, or -1 (endpoint off)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {text!r}") from None
    if not -1 <= value <= 65535:
        raise argparse.ArgumentTypeError(
            f"expected a port 0..65535 (or -1 to turn the endpoint off), got {value}"
        )
    return value
