"""GCRA, the generic cell rate algorithm, as Lua for Redis: the arithmetic every rate limit here shares.

One key per client holds its "theoretical arrival time" (TAT); ``burst / interval + 1``
requests may come at once, then one per ``interval``. Times are microseconds on Redis's own
clock, so every web process agrees. A check answers 0 (allowed, and counted) or the
milliseconds to wait (refused, not counted).

``gcra_lease`` is the same arithmetic for ``want`` requests at once: it grants as many as fit now
(at least one, or none and the wait), counts them, and first takes back ``back`` requests granted
earlier and never made (never below "now": an idle client's allowance is not raised by it).
``gcra`` is a lease of one.

Two scripts use it: ``gpushare.throttling`` (one limit per round trip) and
``accounts.principal_cache`` (a token's version and every rate limit of the request together,
one round trip for both), run by :func:`script_run`. No Django here.
"""

from __future__ import annotations

from redis import exceptions as redis_errors

GCRA_FUNCTION = """
local function gcra_lease(key, interval, burst, now, want, back)
  local tat = tonumber(redis.call('GET', key) or now)
  if back > 0 then tat = tat - back * interval end
  if tat < now then tat = now end
  local room = burst - (tat - now)
  if room < 0 then
    if back > 0 then
      redis.call('SET', key, string.format('%d', tat), 'PX', math.ceil((tat - now) / 1000) + 1000)
    end
    return 0, math.ceil(-room / 1000)
  end
  local granted = math.min(want, math.floor(room / interval) + 1)
  local tat_new = tat + granted * interval
  redis.call('SET', key, string.format('%d', tat_new), 'PX', math.ceil((tat_new - now) / 1000) + 1000)
  return granted, 0
end
local function gcra(key, interval, burst, now)
  local _, wait = gcra_lease(key, interval, burst, now, 1, 0)
  return wait
end
local function now_us()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000000 + tonumber(t[2])
end
"""

# KEYS[1] the client's key; ARGV interval and burst (µs).
GCRA = GCRA_FUNCTION + "return gcra(KEYS[1], tonumber(ARGV[1]), tonumber(ARGV[2]), now_us())\n"


def gcra_args(num_requests: int, duration_s: float) -> tuple[int, int]:
    """``(interval, burst)`` in microseconds for "num_requests per duration_s"."""
    interval = max(1, round(duration_s * 1_000_000 / num_requests))
    return interval, interval * (num_requests - 1)


def script_run(client, script, keys: list, args: list):
    """``script(keys=keys, args=args)`` (a redis-py ``Script`` of ``client``'s) on one pooled connection,
    without redis-py's per-command machinery (its retry wrapper, option parsing and observability hooks:
    ~25 us of CPU of an API request's ~65 us for its one Redis call). A pooled connection the server has
    closed meanwhile is replaced once; a script the server does not know (restarted, ``SCRIPT FLUSH``) is
    loaded and run again. Errors are redis-py's own."""
    pool = client.connection_pool
    reconnected = loaded = False  # each at most once: a Redis restart does both
    while True:
        conn = pool.get_connection()
        try:
            conn.send_command("EVALSHA", script.sha, len(keys), *keys, *args)
            return conn.read_response()
        except redis_errors.NoScriptError:
            if loaded:
                raise
            loaded = True
            script.sha = client.script_load(script.script)
        except redis_errors.ConnectionError:
            conn.disconnect()
            if reconnected:
                raise
            reconnected = True
        except BaseException:
            conn.disconnect()  # a timeout or an interrupted read leaves the reply unread: never reuse it
            raise
        finally:
            pool.release(conn)
