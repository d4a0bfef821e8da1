"""The flag tables of docs/serving.md, made from `pageserve serve`'s own parser:
`python -m pageserve.app.flag_table` prints them, `--write docs/serving.md` puts them between
the file's markers. tests/test_docs.py fails when the file's tables differ from these."""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

BEGIN = "<!-- flags:begin: made by `python -m pageserve.app.flag_table --write docs/serving.md`, not by hand -->"
END = "<!-- flags:end -->"
REGENERATE = "python -m pageserve.app.flag_table --write docs/serving.md"


def serve_parser() -> argparse.ArgumentParser:
    from pageserve.app import serve
    from pageserve.app.cli import HelpFormatter

    parser = argparse.ArgumentParser(prog="pageserve serve", formatter_class=HelpFormatter)
    serve.add_args(parser)
    return parser


def _invocation(action: argparse.Action) -> str:
    if isinstance(action, argparse.BooleanOptionalAction):
        return "--[no-]" + action.option_strings[0][2:]
    names = ", ".join(action.option_strings)
    if action.nargs == 0:
        return names
    formatter = argparse.HelpFormatter("pageserve")
    return f"{names} {formatter._format_args(action, formatter._get_default_metavar_for_optional(action))}"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;")


def flag_tables(parser: argparse.ArgumentParser | None = None) -> str:
    """One table a --help group, in --help's order: flag, default, the help line; then the vLLM
    flags that are not taken (app/vllm_flags.py)."""
    from pageserve.app.cli import shown_default

    parser = parser or serve_parser()
    out = []
    for group in parser._action_groups:
        actions = [a for a in group._group_actions if a.option_strings and a.help != argparse.SUPPRESS
                   and "--help" not in a.option_strings]
        if not actions:
            continue
        out += [f"### {group.title}", "", "| flag | default | what it does |", "|---|---|---|"]
        for a in actions:
            help_text = (a.help or "").replace(" (default: %(default)s)", "").replace("%%", "%")
            default = shown_default(a)
            if default is not None:
                default = f"`{default}`"
            elif said := re.search(r" \(default: (.+)\)$", help_text):  # a default in words
                help_text, default = help_text[:said.start()], _cell(said.group(1))
            out.append(f"| `{_invocation(a)}` | {default or ''} | {_cell(help_text)} |")
        out.append("")
    from pageserve.app.vllm_flags import NOT_TAKEN

    out += ["### vLLM flags pageserve does not take", "", "`pageserve serve` answers each with this line.", "",
            "| flag | instead |", "|---|---|"]
    out += [f"| `{flag}` | {_cell(why)} |" for flag, why in NOT_TAKEN.items()]
    return "\n".join(out).rstrip("\n") + "\n"


def replace_tables(text: str, tables: str) -> str:
    """`text` with what lies between the markers replaced by `tables`."""
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    return text[:start] + "\n" + tables + text[end:]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pageserve.app.flag_table", description=__doc__)
    ap.add_argument("--write", type=Path, metavar="FILE", help="replace the tables between FILE's markers")
    ns = ap.parse_args(argv)
    tables = flag_tables()
    if ns.write is None:
        sys.stdout.write(tables)
    else:
        ns.write.write_text(replace_tables(ns.write.read_text(), tables))
    return 0


if __name__ == "__main__":
    sys.exit(main())
