-- Which ready jobs a claim takes when it cannot simply pop the head: under a cap, or when the claimant is one kind
-- of capacity of a queue served by two (a fleet of GPU workers with serverless overflow).
-- - 'fleet' (a GPU worker): never a job a dispatch worker may have sent to a provider (a remote id, or a submit
--   intent open): that job is the overflow worker's to resume; running it on a machine too would pay twice.
-- - 'overflow' (the queue's dispatch worker): those jobs first (wherever they are in the head), then the jobs the
--   fleet will not start in time: past `skip`, the jobs the fleet starts within `after` by the autoscaler's last
--   estimate (the `flow` hash: skip, idle, per_ms, run_ms, after_ms); before it, a job that has waited `after`
--   already, or whose deadline falls before its predicted start (idle machines take the first jobs at once, then
--   one every per_ms) plus a run. No estimate (no autoscaler, or a stale one expired): only the waited rule.
--- @include "records"
local PICK_FIELDS = {'remote_id', 'sub_open', 'cancel', 'ready_at', 'created_at', 'deadline'}
local FLEET_SCAN = 2000  -- sent-out jobs a fleet claim looks past: an overflow worker's in-flight jobs, if it died
local HEAD_SCAN = 200  -- jobs a scan looks at: the head under a cap, or an overflow claim's head and its tail

local function sent_out(remote_id, sub_open)
  return (remote_id or '') ~= '' or sub_open == '1'
end

-- Up to `n` ready jobs from position `from`, looking at most `limit` positions, for which
-- `take(id, position, remote_id, sub_open, cancel, ready_at, created_at, deadline)` is true; appended to `picked`.
local function scan_ready(picked, from, limit, n, take)
  local pos, stop = from, from + limit
  local chunk_size = math.max(2 * n, 16)
  while #picked < n and pos < stop do
    local chunk = redis.call('ZRANGE', P .. 'ready', pos, math.min(pos + chunk_size, stop) - 1)
    if #chunk == 0 then break end
    for _, id in ipairs(chunk) do
      if take(id, pos, unpack(redis.call('HMGET', jkey(id), unpack(PICK_FIELDS)))) then
        picked[#picked + 1] = id
        if #picked >= n then break end
      end
      pos = pos + 1
    end
  end
  return picked
end

local function pick_fleet(n, allowed)
  return scan_ready({}, 0, FLEET_SCAN, n, function(id, _, remote_id, sub_open, cancel)
    return not sent_out(remote_id, sub_open) and allowed(id, remote_id, cancel)
  end)
end

local function pick_overflow(n, now, after_ms, allowed)
  local skip, idle, per_ms, run_ms, est_after = unpack(redis.call('HMGET', P .. 'flow', 'skip', 'idle', 'per_ms',
    'run_ms', 'after_ms'))
  skip, idle, per_ms, run_ms = tonumber(skip), tonumber(idle) or 0, tonumber(per_ms) or 0, tonumber(run_ms) or 0
  after_ms = tonumber(est_after) or after_ms
  local head = skip and math.min(skip, HEAD_SCAN) or HEAD_SCAN
  local picked = scan_ready({}, 0, head, n, function(id, pos, remote_id, sub_open, cancel, ready_at, created_at,
      deadline)
    if not allowed(id, remote_id, cancel) then return false end
    if sent_out(remote_id, sub_open) then return true end
    if now - tonumber(ready_at or created_at or now) >= after_ms then return true end
    if deadline and skip then
      local start = now + math.max(0, pos + 1 - idle) * per_ms
      return start + run_ms > tonumber(deadline)
    end
    return false
  end)
  if skip then  -- the fleet's share ends at `skip`: every job after it is overflow's
    scan_ready(picked, skip, HEAD_SCAN, n, function(id, _, remote_id, _, cancel)
      return allowed(id, remote_id, cancel)
    end)
  end
  return picked
end

-- The jobs a claim of `mode` takes ('' under a cap: the head's allowed jobs). `allowed(id, remote_id, cancel)`:
-- what a cap lets through (everything when there is none).
local function pick(mode, n, now, after_ms, allowed)
  if mode == 'fleet' then return pick_fleet(n, allowed) end
  if mode == 'overflow' then return pick_overflow(n, now, after_ms, allowed) end
  return scan_ready({}, 0, HEAD_SCAN, n, function(id, _, remote_id, _, cancel)
    return allowed(id, remote_id, cancel)
  end)
end
