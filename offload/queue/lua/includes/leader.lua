-- The autoscaler's lock value, "owner|token|expiry ms" (offload/autoscale/leader.py): nil parts when the value
-- is anything else, which no check then accepts.
local function lock_parts(value)
  return string.match(value, '^([^|]*)|([^|]*)|([^|]*)$')
end
