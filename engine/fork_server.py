"""The fork server's guard, imported first when it starts (``engine.processes.PRELOAD``).

The fork server is the parent of every shard, router and front end, and each of them dies with
its parent (``die_with_parent``). Importing this module makes the fork server itself die with
its own parent (the launcher, or the process that built an ``Engine``), however that one dies:
kill -9 of the launcher then takes the fork server, and with it every process it forked.
"""
from engine.processes import die_with_parent

die_with_parent()
