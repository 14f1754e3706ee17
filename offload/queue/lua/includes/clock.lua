-- The time a script acts at, in ms: ARGV's `now` when the caller gives one (tests run on a virtual clock),
-- else the server's own clock, so every caller on every machine agrees whatever their clocks say.
local function now_ms(arg)
  if arg ~= nil and arg ~= '' then return tonumber(arg) end
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

local DAY_MS = 86400000

-- The cap window of a time: its UTC day as digits (20261130), from the days since the epoch (the civil-from-days
-- algorithm of H. Hinnant's date library: scripts have no os.date). One rule for every caller: the window is the
-- store's day, never a worker's.
local function window_of(now)
  local z = math.floor(now / DAY_MS) + 719468
  local era = math.floor(z / 146097)
  local doe = z - era * 146097
  local yoe = math.floor((doe - math.floor(doe / 1460) + math.floor(doe / 36524) - math.floor(doe / 146096)) / 365)
  local doy = doe - (365 * yoe + math.floor(yoe / 4) - math.floor(yoe / 100))
  local mp = math.floor((5 * doy + 2) / 153)
  local d = doy - math.floor((153 * mp + 2) / 5) + 1
  local m = mp < 10 and mp + 3 or mp - 9
  local y = yoe + era * 400
  if m <= 2 then y = y + 1 end
  return string.format('%04d%02d%02d', y, m, d)
end

-- ms from `now` until the next cap window begins (the next UTC midnight).
local function window_left(now)
  return (math.floor(now / DAY_MS) + 1) * DAY_MS - now
end
