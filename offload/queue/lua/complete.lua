-- Batched so a worker acks many jobs in one round trip. A repeat of a complete that already went through (its
-- reply was lost and the client retried) answers OK again instead of STALE. A known cost settles the job's cap
-- reservation (the real cost replaces the worst case) in the same step.
-- KEYS: [1] the queue's key prefix, offload:{<queue>}: (see offload/queue/keys.py)
-- ARGV: now, items: a JSON list of [id, token, result location, cost or ""]
-- Returns: per job OK, STALE or NOTFOUND
--- @include "common"
local now = now_ms(ARGV[1])
local out, done, owners, infos, extra, seen, runs = {}, {}, {}, {}, {}, {}, {}
for _, item in ipairs(cjson.decode(ARGV[2])) do
  local id, token, result, cost = item[1], item[2], item[3], item[4]
  local f, err = nil, nil
  if seen[id] then  -- the same job twice in one batch: the first item decided it
    if seen[id] == token then err = 'REPEAT' else err = 'STALE' end
  else
    f, err = owned(id, token)
  end
  if err == 'REPEAT' then
    out[#out + 1] = 'OK'
  elseif err == 'STALE' and redis.call('HGET', jkey(id), 'state') == 'succeeded'
      and redis.call('HGET', jkey(id), 'token') == token then
    out[#out + 1] = 'OK'
  elseif err then
    out[#out + 1] = err
  else
    if cost ~= '' then
      extra[#extra + 1] = {'result', result, 'cost', cost}
      settle(jkey(id), id, tonumber(cost), false)
    else
      extra[#extra + 1] = {'result', result}
    end
    done[#done + 1] = id
    seen[id] = token
    owners[id] = f[2]
    infos[#infos + 1] = {f[3], f[5]}
    runs[#runs + 1] = now - tonumber(f[4] or now)
    out[#out + 1] = 'OK'
  end
end
unlease(done, owners)
finish(done, 'succeeded', now, nil, infos, extra)
observe('run', runs)
return out
