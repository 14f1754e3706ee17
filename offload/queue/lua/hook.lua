-- A provider webhook whose URL secret the server has already checked (against `hook:<n>`). Fenced by the
-- submission number: only the job's current submission counts, so a late callback of an earlier run can never
-- complete a newer one. It records the remote id when that submission has none (its worker died inside the
-- submit call: adoption, counted), and for a final event keeps the body (`hook_n`, `hook_body`) and tells the
-- worker holding the lease (PUBLISH on its channel) so it stores the result at once; a job nobody holds is
-- resumed by its next claim, which finds the remote id and the body. Duplicates, late and reordered deliveries
-- change nothing, as does a callback of a run already given up (its remote id let go).
-- KEYS: [1] the queue's key prefix, offload:{<queue>}: (see offload/queue/keys.py)
-- ARGV: now, job id, submission number, remote id ('' unknown), terminal ('1' / '0'), body
-- Returns: WAKE (final event kept, owner told), KEPT (final event kept, nobody holds the job), ADOPTED / OK
--   (not final), DUP, LATE (the job is finished), STALE (an earlier submission), MISMATCH (another remote id than the one
--   recorded for this submission), NOTFOUND.
--- @include "common"
local now = now_ms(ARGV[1])
local id, n, remote, terminal, body = ARGV[2], tonumber(ARGV[3]), ARGV[4], ARGV[5] == '1', ARGV[6]
local k = jkey(id)
local g = redis.call('HMGET', k, 'state', 'sub_n', 'remote_n', 'remote_id', 'hook_n', 'owner', 'sub_open')
if not g[1] then return 'NOTFOUND' end
if g[1] == 'succeeded' or g[1] == 'dead' or g[1] == 'cancelled' then return 'LATE' end
if tonumber(g[2] or '') ~= n then return 'STALE' end
local verdict = 'OK'
if tonumber(g[3] or '') == n and g[4] and g[4] ~= '' then
  if remote ~= '' and g[4] ~= remote then return 'MISMATCH' end
elseif g[7] ~= '1' then
  -- no remote job recorded and no intent open: this run is over (it failed or expired and its remote id was
  -- let go, or the provider refused the submit); a late callback of it must not bring its remote id back
  return 'STALE'
elseif remote ~= '' then
  redis.call('HSET', k, 'remote_id', remote, 'remote_n', n, 'sub_open', '0', 'adopted_at', now)
  redis.call('HINCRBY', k, 'adopted', 1)
  count('adopted', 1)
  verdict = 'ADOPTED'
end
if not terminal then return verdict end
if tonumber(g[5] or '') == n then return 'DUP' end
redis.call('HSET', k, 'hook_n', n, 'hook_body', body, 'hook_at', now)
if (g[1] == 'active' or g[1] == 'submitted') and g[6] and g[6] ~= '' then
  redis.call('PUBLISH', P .. 'hooks:' .. g[6], id .. ' ' .. n)
  return 'WAKE'
end
return 'KEPT'
