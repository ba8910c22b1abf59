--[[
  leave_7.lua: graceful leave of one engine; takes effect atomically.

  KEYS: the seven keys of common.lua.
  ARGV[1] deployment name, ARGV[2] "PUBLISH" or "SPUBLISH", ARGV[3] engine id
  Returns: {removed (1, or 0 if it was not a member: retries are harmless),
            version of the snapshot published for the change, 0 if none}
]]

cold() -- the cold paths' helpers (common.lua)
local deployment, pubcmd = ARGV[1], ARGV[2]
local err = common_args(deployment, pubcmd, 3, 3)
if err then return fail(err) end
local engine = name_arg(ARGV[3])
if not engine then return fail('bad engine_id: ' .. tostring(ARGV[3])) end
if not redis.call('HGET', K_REPORTS, F_EPOCH) then return {0, 0} end
local removed = remove_engine(engine, 'left')
local version = 0
if removed == 1 then
  version = publish_after_change(config(), now_ms(), deployment, pubcmd)
end
return {removed, version}
