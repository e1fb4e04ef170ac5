"""`splitflash models pull NAME` and `splitflash models list`."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from splitflash.models import store


def register(sub) -> None:
    parser = sub.add_parser("models", help="fetch and list models in the local cache")
    verbs = parser.add_subparsers(dest="verb", required=True)
    pull = verbs.add_parser("pull", help="fetch a known model into the cache")
    pull.add_argument("name", choices=sorted(store.KNOWN_MODELS))
    pull.set_defaults(run=run_pull)
    lister = verbs.add_parser("list", help="show the cache")
    lister.set_defaults(run=run_list)


def run_pull(args) -> int:
    store.pull(args.name)
    return 0


def run_list(args) -> int:
    table = Table(title=f"models in {store.cache_dir()}")
    for col in ("name", "present", "size MB", "path", "description"):
        table.add_column(col)
    for row in store.list_models():
        table.add_row(
            row["name"],
            "yes" if row["present"] else "no",
            str(row["size_mb"] or "-"),
            row["path"],
            row["description"],
        )
    Console().print(table)
    return 0
