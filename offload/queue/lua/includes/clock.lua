-- The time a script acts at, in ms: ARGV's `now` when the caller gives one (tests run on a virtual clock),
-- else the server's own clock, so every caller on every machine agrees whatever their clocks say.
local function now_ms(arg)
  if arg ~= nil and arg ~= '' then return tonumber(arg) end
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
