-- The completion-webhook outbox (offload/server/callbacks.py sends from it): `cb:due` holds the job ids whose
-- webhook is owed, scored by when the next try is due (a claimed one by its claim's end), `cb:info` each one's
-- tries, last error and the claiming sender's token (JSON), `cb:failed` the dead-lettered ones by when.
--- @include "records"

-- Whether the queue has a callback URL of its own (the server writes `cb:url` from offload.yaml at start).
local function queue_callback()
  return redis.call('EXISTS', P .. 'cb:url') == 1
end

-- Owe a webhook for each of `ids`, due now. One already owed (a claim in flight) keeps its place; a new one
-- starts with no tries, and leaves the dead letter of an earlier end of the same job (a requeued dead job).
local function outbox_add(ids, now)
  for _, id in ipairs(ids) do
    if redis.call('ZADD', P .. 'cb:due', 'NX', now, id) == 1 then
      redis.call('HDEL', P .. 'cb:info', id)
      redis.call('ZREM', P .. 'cb:failed', id)
    end
  end
end

-- Jobs whose records were deleted take their webhooks (owed or dead-lettered) with them.
local function outbox_forget(ids)
  if #ids == 0 or redis.call('HLEN', P .. 'cb:info') + redis.call('ZCARD', P .. 'cb:due') == 0 then return end
  bulk('ZREM', P .. 'cb:due', ids)
  bulk('ZREM', P .. 'cb:failed', ids)
  bulk('HDEL', P .. 'cb:info', ids)
end
