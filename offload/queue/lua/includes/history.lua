-- The queue's bounded history: per UTC minute, hour and day, counts by outcome, the wait and run histograms in
-- /metrics' buckets, spend by kind of capacity and by backend, provider calls and errors, and the server's gauges.
-- Written by the script that makes the change, in the same step: a script that fails part-way wrote nothing, and a
-- repeat that changes nothing counts nothing. One hash per bucket, `history:<m|h|d>:<its start, unix s>`, all three
-- written at once (no roll-up job to fall behind), each expiring its resolution's retention after the bucket ends.
-- `history:cfg` (the server writes it from offload.yaml's `history:`) turns it off or sets the retention; without
-- it the defaults hold. The time is the script's `now`: the store's clock.
--- @include "records"
local HISTORY_RES = {{P .. 'history:m:', 60000}, {P .. 'history:h:', 3600000}, {P .. 'history:d:', 86400000}}
local HISTORY_KEEP_MS = {__HISTORY_KEEP_MS__}
local history_keep = nil  -- read once per script run: the retention per resolution (ms), or false when off
local history_kept = {}  -- the buckets this script run set the expiry of already

local function history_cfg()
  if history_keep == nil then
    local on, m, h, d = unpack(redis.call('HMGET', P .. 'history:cfg', 'on', 'm', 'h', 'd'))
    if on == '0' then
      history_keep = false
    else
      history_keep = {tonumber(m) or HISTORY_KEEP_MS[1], tonumber(h) or HISTORY_KEEP_MS[2],
        tonumber(d) or HISTORY_KEEP_MS[3]}
    end
  end
  return history_keep
end

-- Each resolution's bucket of `now`: calls fn(key, ms the key is kept from now).
local function history_buckets(now, fn)
  local keep = history_cfg()
  if not keep then return end
  for r = 1, 3 do
    local span = HISTORY_RES[r][2]
    local start = now - now % span
    fn(HISTORY_RES[r][1] .. fmt(start / 1000), start + span + keep[r] - now)
  end
end

-- Add to `now`'s buckets: `fields` a flat {name, n, ...} of integers, an n of 0 (or nil) skipped. Money is added
-- in nano-USD (`history_usd`): HINCRBY, cheaper than HINCRBYFLOAT, and exact.
local function history_add(now, fields)
  history_buckets(now, function(key, ttl)
    local wrote = false
    for i = 1, #fields, 2 do
      local n = fields[i + 1]
      if n and n ~= 0 then
        redis.call('HINCRBY', key, fields[i], n)
        wrote = true
      end
    end
    if wrote and not history_kept[key] then
      redis.call('PEXPIRE', key, fmt(ttl))
      history_kept[key] = true
    end
  end)
end

-- USD as history_add adds it: nano-USD, whole.
local function history_usd(usd) return tonumber(fmt(usd * 1e9)) end

-- A histogram's bucket counts (metrics.lua's `observe` returns them) into `now`'s buckets, as `<name>:<i>`.
local function history_hist(now, name, counts)
  local fields, n = {}, 0
  for i, c in pairs(counts) do
    fields[n + 1], fields[n + 2] = name .. ':' .. i, c
    n = n + 2
  end
  if n > 0 then history_add(now, fields) end
end
