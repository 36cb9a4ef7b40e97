"""wrk Lua scripts for the long-run benchmarks.

- ``distinct_prefix_script``: every request a new prompt prefix (and one of many tenant
  salts), so any per-prefix state a router kept would grow with the request count.
- ``paced_script``: a fixed arrival schedule, wrk2-style. Each time a connection is free
  to send, ``delay()`` hands it the next slot of a schedule of ``rate`` per second from
  the start; a slot already past is sent at once. Latency is measured from the actual
  send, so a step only counts as sustained when the achieved rate keeps up with the
  schedule (otherwise the connection pool ran dry and waits went unmeasured).

Both read the wall clock through LuaJIT's FFI (wrk's Lua has no sub-second clock).
"""

from __future__ import annotations

from pathlib import Path

_CLOCK = """local ffi = require("ffi")
ffi.cdef[[
typedef struct { long tv_sec; long tv_nsec; } prefix_router_timespec;
int clock_gettime(int clk, prefix_router_timespec *tp);
]]
local ts = ffi.new("prefix_router_timespec")
local function now_ms()
  ffi.C.clock_gettime(1, ts)
  return tonumber(ts.tv_sec) * 1000 + tonumber(ts.tv_nsec) / 1e6
end
"""


def distinct_prefix_script(path: Path, first: int, body_bytes: int, tenants: int = 1000) -> Path:
    """POST chat requests whose prompts start with ``first``, ``first + 1``, ...

    Each body is ``body_bytes`` long (give or take the digits of the number); the salt
    header cycles through ``tenants`` values.
    """
    filler = ("lorem ipsum " * (body_bytes // 12 + 1))[: max(body_bytes - 120, 0)]
    path.write_text(
        f"local n = {first - 1}\n"
        f'local filler = "{filler}"\n'
        "request = function()\n"
        "  n = n + 1\n"
        '  local body = \'{"model":"sim-model","max_tokens":1,"messages":[{"role":"user",'
        "\"content\":\"soak prefix ' .. n .. ' ' .. filler .. '\"}]}'\n"
        '  local headers = {["Content-Type"] = "application/json",'
        f' ["x-prefix-aware-id"] = "tenant-" .. (n % {tenants})}}\n'
        '  return wrk.format("POST", "/v1/chat/completions", headers, body)\n'
        "end\n"
    )
    return path


def paced_script(path: Path, request_path: str, bodies: list[bytes], rate_per_s: float) -> Path:
    """POST ``bodies`` in rotation at ``rate_per_s`` on a fixed schedule (one wrk thread)."""
    literals = ",\n".join(f"[==[{b.decode()}]==]" for b in bodies)
    path.write_text(
        _CLOCK + f"local bodies = {{\n{literals}\n}}\nlocal i = 0\n"
        f"local interval = {1000.0 / rate_per_s!r}\nlocal next_at = nil\n"
        "delay = function()\n"
        "  local now = now_ms()\n"
        "  if next_at == nil then next_at = now end\n"
        "  local wait = next_at - now\n"
        "  next_at = next_at + interval\n"
        "  if wait <= 0 then return 0 end\n"
        "  return math.floor(wait + 0.5)\n"
        "end\n"
        "request = function()\n  i = i % #bodies + 1\n"
        f'  return wrk.format("POST", "{request_path}", '
        '{["Content-Type"] = "application/json"}, bodies[i])\nend\n'
    )
    return path
