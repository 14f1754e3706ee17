-- What the queue's cap window has counted so far, for status views and metrics: the window is the store's UTC day
-- (`window_of` in clock.lua), the one the claim and begin scripts count in, whatever the reader's clock says.
-- KEYS: [1] the queue's key prefix, offload:{<queue>}: (see offload/queue/keyspace.py)
-- ARGV: now
-- Returns: {the window (digits, e.g. 20261130), jobs counted, spend reserved (a string: a float)}
--- @include "clock"
--- @include "caps"
local window = window_of(now_ms(ARGV[1]))
local base = cap_base(window)
return {window, tonumber(redis.call('GET', base .. 'jobs') or '0'), redis.call('GET', base .. 'spend') or '0'}
