-- The queue's keys and job records, for every queue script. KEYS[1] is the queue's key prefix, e.g. "offload:{gpu}:",
-- so every key a script touches carries the queue's hash tag and lives in one cluster slot.
-- A script's cost is mostly the number of redis.call()s it makes: hot paths batch their set updates (one ZADD/SREM
-- for many jobs) and write each job hash once. In a per-job loop, append with a running count, not `t[#t + 1]` (`#`
-- is a search each time in Lua 5.1), pass a job's fields to HSET as arguments instead of building a table to unpack,
-- and read fields into named locals (`local state, token = unpack(redis.call('HMGET', k, 'state', 'token'))`), not
-- into a table keyed by name per job (docs/explanation/performance.md).
-- Every script is safe to run twice with the same arguments (a reply lost on the way back, then the client sending
-- the command again, as cluster clients do on their own): the second run changes nothing more.
-- ARGV[1] of every queue script is `now`, in ms ('' = the server's clock, TIME): tests run on a virtual clock.
local P = KEYS[1]
local QUEUE = string.match(P, '{(.-)}')
local CHUNK = 500
local TERMINAL = {succeeded = true, dead = true, cancelled = true}  -- states a job never leaves

local function jkey(id) return P .. 'job:' .. id end

local function fmt(n) return string.format('%.0f', n) end

-- cmd key m1 [m2 ...] in chunks, so thousands of members cost a handful of calls.
local function bulk(cmd, key, members)
  for i = 1, #members, CHUNK do
    redis.call(cmd, key, unpack(members, i, math.min(i + CHUNK - 1, #members)))
  end
end

-- ZADD key s1 m1 s2 m2 ... from a flat {score, member, ...} list.
local function bulk_zadd(key, pairs)
  for i = 1, #pairs, 2 * CHUNK do
    redis.call('ZADD', key, unpack(pairs, i, math.min(i + 2 * CHUNK - 1, #pairs)))
  end
end
