-- The cap check and the count are one step, so any number of callers together count exactly `cap` jobs per
-- window; items are decided in order, as if reserved one by one. A job already counted in this window passes
-- without being counted again. (Workers reserve inside begin.lua, with the submit intent; this is the same rule
-- for callers that only count.)
-- KEYS: [1] the queue's key prefix, offload:{<queue>}: (see offload/queue/keyspace.py)
-- ARGV: now, job cap ('' = none), spend cap ('' = none), items: a JSON list of [id, estimated cost]. The window
--   is the store's UTC day (`window_of` in clock.lua).
-- Returns: per item OK, CAP:jobs or CAP:spend
--- @include "clock"
--- @include "caps"
local window = window_of(now_ms(ARGV[1]))
local job_cap, spend_cap = tonumber(ARGV[2]), tonumber(ARGV[3])
local st = cap_open(window)
local out = {}
for _, item in ipairs(cjson.decode(ARGV[4])) do
  local id, estimate = item[1], tonumber(item[2])
  local verdict = cap_take(st, id, estimate, job_cap, spend_cap, false)
  if verdict then out[#out + 1] = 'CAP:' .. verdict else out[#out + 1] = 'OK' end
end
cap_commit(st)
return out
