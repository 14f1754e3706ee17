-- The queue's counters and latency histograms for /metrics, kept in Redis so every server process reports the same
-- numbers.
--- @include "records"

local function count(field, n)
  if n > 0 then redis.call('HINCRBY', P .. 'stats', field, n) end
end

-- ms values into fixed buckets, one hash per queue. One HINCRBY per distinct bucket per batch. Returns the counts
-- per bucket index, for the history (history.lua's `history_hist`).
local HIST_BUCKETS = {__HIST_BUCKETS__}
local function observe(name, values)
  if #values == 0 then return {} end
  local counts, sum = {}, 0
  for _, v in ipairs(values) do
    if v < 0 then v = 0 end
    sum = sum + v
    local i = #HIST_BUCKETS + 1
    for j, b in ipairs(HIST_BUCKETS) do
      if v <= b then i = j; break end
    end
    counts[i] = (counts[i] or 0) + 1
  end
  for i, c in pairs(counts) do redis.call('HINCRBY', P .. 'hist', name .. ':' .. i, c) end
  redis.call('HINCRBY', P .. 'hist', name .. ':count', #values)
  redis.call('HINCRBY', P .. 'hist', name .. ':sum', fmt(sum))
  return counts
end
