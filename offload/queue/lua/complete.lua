-- ARGV: now, count, then per job: id, token, result location, cost. Batched so a worker acks many jobs
-- in one round trip. Returns per job OK, STALE or NOTFOUND. A repeat of a complete that already went
-- through (its reply was lost and the client retried) answers OK again instead of STALE.
local now = now_ms(ARGV[1])
local n = tonumber(ARGV[2])
local out, done, owners, rets, extra = {}, {}, {}, {}, {}
local i = 3
for _ = 1, n do
  local id, token, result, cost = ARGV[i], ARGV[i + 1], ARGV[i + 2], ARGV[i + 3]
  i = i + 4
  local f, err = owned(id, token)
  if err == 'STALE' and redis.call('HGET', jkey(id), 'state') == 'succeeded'
      and redis.call('HGET', jkey(id), 'token') == token then
    out[#out + 1] = 'OK'
  elseif err then
    out[#out + 1] = err
  else
    if cost ~= '' then
      extra[#extra + 1] = {'result', result, 'cost', cost}
    else
      extra[#extra + 1] = {'result', result}
    end
    done[#done + 1] = id
    owners[id] = f[2]
    rets[#rets + 1] = f[3]
    out[#out + 1] = 'OK'
  end
end
unlease(done, owners)
finish(done, 'succeeded', now, nil, rets, extra)
return out
