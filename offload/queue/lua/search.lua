-- One chunk of a state's set, filtered, for the job search and the dead letter's error groups
-- (offload/queue/search.py): one call reads up to count ids and their fields instead of one HMGET per job from
-- Python. The error fragment is matched as plain text (string.find with plain=true: never a Lua pattern), case-
-- insensitively (the caller lowercases it). A job whose record is gone (trimmed since it was indexed) is left out.
-- Read-only.
-- KEYS: [1] the queue's key prefix, offload:{<queue>}: (see offload/queue/keyspace.py)
-- ARGV: now (unused), set name, newest first (1 or 0), start index, count to read, matches wanted, id prefix,
--       backend, lowercased error fragment, idempotency key, created from, created to, finished from, finished to
--       (times in ms; '' = no filter, for every filter)
-- Returns: {ids consumed (it stops after the match that makes the matches wanted), 1 if the set ended else 0,
--          {id, error, id, error, ...} of the matches}
--- @include "records"
local start, count, wanted = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
local pre, backend, frag, idem = ARGV[7], ARGV[8], ARGV[9], ARGV[10]
local function bound(v, default) if v == '' then return default end return tonumber(v) end
local c_from, c_to = bound(ARGV[11], -math.huge), bound(ARGV[12], math.huge)
local f_from, f_to = bound(ARGV[13], -math.huge), bound(ARGV[14], math.huge)
local timed = ARGV[13] ~= '' or ARGV[14] ~= ''
local range = {'ZRANGE', P .. ARGV[2], start, start + count - 1}
if ARGV[3] == '1' then range[5] = 'REV' end
local ids = redis.call(unpack(range))
local out, n, used = {}, 0, 0
for _, id in ipairs(ids) do
  if n >= 2 * wanted then break end
  used = used + 1
  if pre == '' or string.sub(id, 1, #pre) == pre then
    local created, finished, be, err, key = unpack(redis.call(
      'HMGET', jkey(id), 'created_at', 'finished_at', 'backend', 'error', 'idem'))
    local ok = created ~= false
      and (backend == '' or be == backend)
      and (idem == '' or key == idem)
      and (frag == '' or (err and string.find(string.lower(err), frag, 1, true) ~= nil))
    if ok then
      local c = tonumber(created)
      ok = c >= c_from and c <= c_to
    end
    if ok and timed then
      local f = tonumber(finished or '')
      ok = f ~= nil and f >= f_from and f <= f_to
    end
    if ok then
      out[n + 1], out[n + 2] = id, err or ''
      n = n + 2
    end
  end
end
return {used, (#ids < count and used == #ids) and 1 or 0, out}
