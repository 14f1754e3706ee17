-- The ready set: jobs waiting to be claimed, scored by priority then arrival (PRIO_SPAN sequence numbers per
-- priority level), and the wake-up of idle workers when it fills again.
--- @include "records"
--- @include "events"
local PRIO_SPAN = 1000000000000  -- 1e12 sequence numbers per priority level

-- Jobs became ready: if a claim found the ready set empty since the last wake (it set `idle`), tell the idle
-- workers at once (they wait on `wake` instead of their next poll, up to 0.5 s away). One message per idle
-- spell, not one per job: a queue whose workers are busy costs a DEL per call and nothing more.
local function wake()
  if redis.call('DEL', P .. 'idle') == 1 then redis.call('PUBLISH', P .. 'wake', '') end
end

-- A job whose cancel waits for its remote job to be cancelled (cancel.lua: a remote job may still run, and is
-- paid while it does) goes ahead of every priority, in a level of its own below 0 (its sequence number kept, so
-- these stay in order too): the next claim cancels it, whatever the backlog.
local function cancel_first(score) return fmt(tonumber(score) % PRIO_SPAN - PRIO_SPAN) end

-- Put jobs into the ready set. A fresh score puts a job behind everything of its priority; a reaped job
-- keeps its old score so it is resumed before newer work.
local function make_ready(ids, now, fresh)
  if #ids == 0 then return end
  local zs = {}
  local seq = 0
  if fresh then seq = redis.call('INCRBY', P .. 'seq', #ids) - #ids end
  for _, id in ipairs(ids) do
    local k = jkey(id)
    local score
    if fresh then
      seq = seq + 1
      local priority, cancel = unpack(redis.call('HMGET', k, 'priority', 'cancel'))
      score = fmt((1000 - tonumber(priority or 0)) * PRIO_SPAN + seq)
      if cancel == '1' then score = cancel_first(score) end
      redis.call('HSET', k, 'state', 'queued', 'score', score, 'ready_at', now, 'owner', '', 'token', '')
    else
      -- and its old ready time: it has been waiting since then
      local old, cancel = unpack(redis.call('HMGET', k, 'score', 'cancel'))
      score = cancel == '1' and cancel_first(old) or old
      redis.call('HSET', k, 'state', 'queued', 'owner', '', 'token', '')
    end
    zs[#zs + 1] = score
    zs[#zs + 1] = id
  end
  bulk_zadd(P .. 'ready', zs)
  event(ids, 'queued')
  wake()
end

-- Due delayed jobs and retries into the ready set, up to `limit` of each.
local function promote(now, limit)
  local moved = 0
  for _, set in ipairs({'delayed', 'retry'}) do
    local due = redis.call('ZRANGEBYSCORE', P .. set, '-inf', now, 'LIMIT', 0, limit)
    if #due > 0 then
      bulk('ZREM', P .. set, due)
      local live = {}
      for _, id in ipairs(due) do
        if redis.call('EXISTS', jkey(id)) == 1 then live[#live + 1] = id end
      end
      make_ready(live, now, true)
      moved = moved + #live
    end
  end
  return moved
end
