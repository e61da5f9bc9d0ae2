"""``kiln key``: this host's artifact signing key, for other hosts' ``KILN_TRUSTED_KEYS``."""
from __future__ import annotations

import json
import sys


def add_parser(sub):
    sp = sub.add_parser("key", help="print this host's artifact signing key (made on first use), "
                        "for other hosts' KILN_TRUSTED_KEYS")
    sp.add_argument("--json", action="store_true")
    sp.set_defaults(fn=cmd_key)


def cmd_key(a, console):
    from kiln.artifact import trust
    trust.host_key()                  # made here on first use
    public = trust.host_public_key()
    if a.json:
        print(json.dumps({"public_key": trust.encode_key(public), "fingerprint": trust.fingerprint(public),
                          "directory": trust.config_dir()}, indent=1))
        return 0
    print(trust.encode_key(public))
    print(f"{trust.fingerprint(public)}: this host's artifact signing key, in {trust.config_dir()}. "
          "Other hosts trust it when this public key (or a file holding it) is in their "
          "KILN_TRUSTED_KEYS.", file=sys.stderr)
    return 0
