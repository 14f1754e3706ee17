-- Spend per kind of capacity: `serverless` (a dispatch worker's run at an API: the cost it recorded) and `fleet`
-- (a GPU worker's run: its share of the machine, run time on the store's clock x the machine's price), per store
-- day (`spend:<window>`, kept as long as the autoscaler's daily rental buckets) and since the queue began (`spent`).
--- @include "records"
--- @include "clock"
--- @include "metrics"
--- @include "history"
local SPEND_KEEP_S = 40 * 86400

-- A run's cost: serverless what the worker recorded (nil: unknown); fleet its run time x the price per hour
-- (nil: unknown, a GPU worker that is no rented instance: counted as `fleet_unpriced`, never as $0).
local function run_cost(kind, given, price_h, started_at, now)
  if kind ~= 'fleet' then return given end
  if not price_h then
    count('fleet_unpriced', 1)
    return nil
  end
  return math.max(now - tonumber(started_at or now), 0) / 3600000 * price_h
end

-- A computed cost as the job record keeps it: enough digits for a second of a cheap machine.
local function fmt_cost(n) return string.format('%.12g', n) end

-- `by_backend`: the same cost split by the backend each run was at ({name = cost}; runs without one left out),
-- for the history.
local function spend_add(kind, cost, now, by_backend)
  if not cost or cost <= 0 then return end
  local day = P .. 'spend:' .. window_of(now)
  redis.call('HINCRBYFLOAT', day, kind, cost)
  redis.call('EXPIRE', day, SPEND_KEEP_S)
  redis.call('HINCRBYFLOAT', P .. 'spent', kind, cost)
  local fields = {'spend:' .. kind, history_usd(cost)}
  for backend, c in pairs(by_backend) do
    fields[#fields + 1], fields[#fields + 2] = 'sb:' .. backend, history_usd(c)
  end
  history_add(now, fields)
end
