-- ARGV: now, id. The job record plus its lease deadline (leases live on the owning worker).
local h = redis.call('HGETALL', jkey(ARGV[2]))
if #h == 0 then return {} end
local owner = redis.call('HGET', jkey(ARGV[2]), 'owner')
local deadline = ''
if owner then deadline = redis.call('ZSCORE', P .. 'workers', owner) or '' end
return {h, deadline}
