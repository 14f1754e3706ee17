-- Extends a backend's cool-down to `ms` from now unless a longer one runs: one step, so two workers' 429s at
-- once can never shorten the longer pause.
-- KEYS: [1] the backend's cool-down key (offload.queue.keyspace.backend_cooldown)
-- ARGV: [1] ms
-- Returns: the cool-down's remaining ms
--- @include "clock"
--- @include "cooldown"
local now = now_ms('')
return cool_for(KEYS[1], now, tonumber(ARGV[1]))
