"""``kiln cache`` (ls, info, prune, clear) and ``kiln parallel-compile``: the compile cache, shown and filled."""
from __future__ import annotations

import argparse
import json

from rich.table import Table

from kiln.cli.common import positive_int


def add_cache(sub):
    sp = sub.add_parser("cache", help="show and manage the compile cache")
    sp.add_argument("action", choices=("ls", "info", "prune", "clear"))
    sp.add_argument("key", nargs="?", help="info: an entry's key (a unique prefix is enough)")
    sp.add_argument("--url", default=None, help="cache URL (default: KILN_CACHE_URL or ~/.cache/kiln)")
    sp.add_argument("--max-bytes", default=None, help="prune: evict least-recently-used entries down to "
                    "this size (e.g. 2G; default KILN_CACHE_MAX_BYTES); without it, prune drops failed entries")
    sp.add_argument("--json", action="store_true")
    sp.set_defaults(fn=cmd_cache)


def add_parallel_compile(sub):
    sp = sub.add_parser("parallel-compile", help="collect the graphs a script compiles, then compile "
                        "them in parallel into the cache: kiln parallel-compile -- python train.py ...")
    sp.add_argument("--workers", type=positive_int, default=None, help="compile processes (default: one per CPU)")
    sp.add_argument("--cache", default=None, help="cache URL (default: KILN_CACHE_URL or ~/.cache/kiln)")
    sp.add_argument("--json", default=None, help="write the per-graph results to this file")
    sp.add_argument("command", nargs=argparse.REMAINDER, help="the script to run, after --")
    sp.set_defaults(fn=cmd_parallel_compile)


def cmd_cache(a, console):
    from kiln.compiler import cache as cache_mod
    url = a.url or cache_mod.resolve_url(None) or cache_mod.default_url()
    store = cache_mod.Cache(url, strict=True)     # a failure is an error (status 2), not a fallback
    cap = cache_mod.parse_max_bytes(a.max_bytes, f"--max-bytes {a.max_bytes!r}") if a.max_bytes else None
    store.check_usable()
    entries = sorted(store.entries(orphans=True), key=lambda e: e.get("last_used", ""), reverse=True)
    if a.action == "ls":
        return _ls(a, console, url, entries)
    if a.action == "info":
        return _info(a, url, store, entries)
    return _delete(a, console, url, store, entries, cap)


def _delete(a, console, url, store, entries, cap):
    """prune or clear; a deletion the location refuses ends it with the count of what did go
    and the reason (status 2), not a count of what was meant to go."""
    from kiln.errors import CacheError
    try:
        if a.action == "clear":
            store.clear()
            removed = entries
        elif cap is not None or store.max_bytes is not None:
            removed = store.evict(cap)
        else:                 # failed entries, and orphans (an artifact its writer left without meta)
            removed = [e for e in entries if e.get("status") != "ok"]
            for e in removed:
                store.forget(e["key"])
    except CacheError:
        try:
            left = {e["key"] for e in store.entries(orphans=True)}
            gone = [e for e in entries if e["key"] not in left]
            console.print(f"removed {len(gone)} of {len(entries)} entries before the failure")
        except CacheError:
            pass
        raise
    if a.action == "clear":
        console.print(f"cleared {len(removed)} entries from {url}")
    else:
        console.print(f"removed {len(removed)} entr{'y' if len(removed) == 1 else 'ies'}, "
                      f"{sum(int(e.get('size', 0)) for e in removed) / 1e6:.1f} MB")
    return 0


def _ls(a, console, url, entries):
    if a.json:
        print(json.dumps(entries, indent=1))
        return 0
    print(f"kiln cache {url}: {len(entries)} entries, "
          f"{sum(int(e.get('size', 0)) for e in entries) / 1e6:.1f} MB")
    if not entries:
        return 0
    t = Table("model", "key", "size", "engine", "status", "created", "last used", "uses")
    for e in entries:
        t.add_row(str(e.get("model_name")), e["key"][:16], f"{int(e.get('size', 0)) / 1e6:.2f} MB",
                  str(e.get("engine", "")), e.get("status", "?"), str(e.get("created", ""))[:19],
                  str(e.get("last_used", ""))[:19], str(e.get("uses", 0)))
    console.print(t)
    return 0


def _info(a, url, store, entries):
    if not a.key:
        print(json.dumps({"url": url, "entries": len(entries),
                          "bytes": sum(int(e.get("size", 0)) for e in entries),
                          "max_bytes": store.max_bytes}, indent=1))
        return 0
    from kiln.errors import KilnError
    from kiln.compiler.cache import valid_name
    if not valid_name(a.key):
        raise KilnError(f"{a.key!r} is not a cache key (or a prefix of one): kiln's keys are hex digits")
    match = [e for e in entries if e["key"].startswith(a.key)]
    if len(match) != 1:
        raise KilnError(f"{len(match)} cache entries match key {a.key!r}; give more of the key")
    print(json.dumps(match[0], indent=1))
    return 0


def cmd_parallel_compile(a, console):
    from kiln.compiler.collect import parallel_compile
    from kiln.errors import KilnError
    command = a.command[1:] if a.command[:1] == ["--"] else a.command
    if not command:
        raise KilnError("kiln parallel-compile needs a command: kiln parallel-compile -- python script.py")
    summary = parallel_compile(command, workers=a.workers, cache_url=a.cache)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(summary, f, indent=1)
    return 1 if any(not j["ok"] for j in summary["jobs"]) else 0
