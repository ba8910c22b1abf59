--[[
  reap_7.lua: coordinator housekeeping. Expires engines whose last report is
  older than dead_after_ms, publishes when that (or the join grace ending)
  completes the barrier, and republishes the current step when nothing was
  published for idle_publish_ms (idle heartbeat, so routers can tell a quiet
  deployment from a dead feed).

  KEYS: the seven keys of common.lua.
  ARGV[1] deployment name, ARGV[2] "PUBLISH" or "SPUBLISH",
  ARGV[3] maximum engines to expire in this call
  ARGV[4] fence token of the caller's lease, or "" (optional; see lease_8.lua)
  Returns: {version published (0 if none), expired engine ids...}
]]

cold() -- the cold paths' helpers (common.lua)
local deployment, pubcmd = ARGV[1], ARGV[2]
local err = common_args(deployment, pubcmd, 3, 4)
if err then return fail(err) end
local limit = int_arg(ARGV[3], 1, 100000)
if not limit then return fail('bad limit: ' .. tostring(ARGV[3])) end
local fence_err = fenced(ARGV[4])
if fence_err then return fence_err end
if not redis.call('HGET', K_REPORTS, F_EPOCH) then return {0} end
local cfg = config()
local now = now_ms()
local dead = reap(cfg, now, limit)
local version
if #dead > 0 then
  version = publish_after_change(cfg, now, deployment, pubcmd)
else
  version = maybe_publish(cfg, now, deployment, pubcmd)
  local pub = published_score()
  if version == 0 and pub >= 0 then
    local last = tonumber(redis.call('HGET', K_META, 'pub_ms') or '0')
    if now - last >= cfg.idle_publish_ms then
      version = publish(pub, now, deployment, pubcmd)
    end
  end
end
local out = {version}
for _, e in ipairs(dead) do out[#out + 1] = e end
return out
