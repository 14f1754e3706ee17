-- A backend's cool-down after a 429 (rate_acquire, cool_down): its end on the store's clock with the reading it
-- was written at, "<until ms> <written ms>". The key's own expiry is no guide: it is kept on the same clock, so a
-- cool-down of a second set just before a step back of an hour would pause every worker for the hour. A step
-- back since it was written (a reading more than a second before it) moves the end back with it, rewritten once.
-- Returns the ms left (0: none).
local function cooling(key, now)
  local raw = redis.call('GET', key)
  if not raw then return 0 end
  local untl, at = string.match(raw, '^(%S+) (%S+)$')
  untl, at = tonumber(untl), tonumber(at)
  if not untl or not at then return math.max(redis.call('PTTL', key), 0) end  -- (a value of an older version)
  if now < at - 1000 then
    untl = untl - (at - now)
    if untl > now then redis.call('SET', key, string.format('%.0f %.0f', untl, now), 'PX', math.ceil(untl - now)) end
  end
  if untl <= now then
    redis.call('DEL', key)
    return 0
  end
  return math.ceil(untl - now)
end

-- Extends the cool-down to `ms` from now unless a longer one runs (cool_down.lua, health.lua); the ms left.
local function cool_for(key, now, ms)
  local left = cooling(key, now)
  if left < ms then
    redis.call('SET', key, string.format('%.0f %.0f', now + ms, now), 'PX', ms)
    left = ms
  end
  return left
end
