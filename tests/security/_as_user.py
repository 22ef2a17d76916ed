"""A trainer running as an unprivileged user (argv[1]: its uid), for the red-team tests.

Started as root by :class:`_hostile.UserTrainer`: it imports everything and scores one honest completion
first (as root, so that no module is left to import from folders the user cannot read), then drops to the
uid (groups, gid, uid: no capability is left) and answers one JSON line per request line on stdin,
``{"program", "spec"}`` -> ``{"reward"}`` (or ``{"error"}``). The first line it writes says who it is and
what isolation it found.
"""

from __future__ import annotations

import json
import os
import sys

from _hostile import ADD_SPECS, HONEST, honest

from sparrow_nemo.rewards.code import code_reward
from sparrow_nemo.rewards.sandbox_os import probe


def main() -> None:
    uid = int(sys.argv[1])
    assert code_reward(HONEST, honest(ADD_SPECS["humaneval"])) == 1.0
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)
    iso = probe()
    print(json.dumps({"euid": os.geteuid(), "available": iso.available, "missing": iso.missing}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        try:
            reply = {"reward": code_reward(request["program"], request["spec"])}
        except Exception as exc:
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(reply), flush=True)


if __name__ == "__main__":
    main()
