-- The queue's capped stream of state changes (dashboards, --watch, the fault harness).
--- @include "records"
local EVENTS_MAX = __EVENTS_MAX__
local EVENT_IDS = 100  -- job ids per stream entry: an entry (and so the capped stream) stays bounded

-- Stream entries {state, space-separated job ids}, at most EVENT_IDS ids each.
local function event(ids, state)
  for i = 1, #ids, EVENT_IDS do
    redis.call('XADD', P .. 'events', 'MAXLEN', '~', EVENTS_MAX, '*', 'state', state, 'jobs',
      table.concat(ids, ' ', i, math.min(i + EVENT_IDS - 1, #ids)))
  end
end
