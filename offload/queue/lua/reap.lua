#!lua flags=allow-oom
-- Maintenance: promote due delayed jobs, return dead workers' jobs, and delete the records of finished jobs whose
-- retention ran out.
-- KEYS: [1] the queue's key prefix, offload:{<queue>}: (see offload/queue/keyspace.py)
-- ARGV: now, limit, silence ms
-- Returns: {promoted, reaped, trimmed, the ms the store's clock stepped back since a heartbeat or
--   maintenance pass last said so (0: none; `shift_back` in outages.lua)}
--- @include "clock"
--- @include "ready"
--- @include "terminal"
--- @include "leases"
--- @include "outages"
local now = now_ms(ARGV[1])
local limit = tonumber(ARGV[2])
local trimmed = trim(now, limit)  -- first: a store at its maxmemory gets the room back before anything is written
local _, stepped = stamp(now, tonumber(ARGV[3]), true)
local promoted = promote(now, limit)
local reaped = reap(now, limit)
return {promoted, reaped, trimmed, stepped}
