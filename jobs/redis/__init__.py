"""Redis plumbing: connecting, the embedded server, key names, Lua scripts, leases, heartbeats."""
