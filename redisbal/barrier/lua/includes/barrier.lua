--[[
  barrier: when a snapshot is due.

  The barrier is a counter, not a scan: .behind (includes/deployment.lua)
  counts the barrier members whose latest report is at or before the published
  score. A report that moves a member past it decrements the counter; at 0
  every member has reported a newer step and the snapshot for the lowest of
  their steps is published: O(1) per report, O(N) once per step. The protocol
  and its invariants: docs/DESIGN.md.
]]
--- @include "deployment"
--- @include "generation"
--- @include "publish"

-- Publish when every barrier member has reached a step past .pub. The first
-- snapshot of a recovered generation also waits join_grace_ms from its start,
-- so that the engines re-registering after a state loss are all in it.
-- Returns the version published, 0 if none.
local function maybe_publish(d, now)
  local h = redis.call('HMGET', d.reports, '.pub', '.behind')
  if (tonumber(h[2]) or 0) > 0 then return 0 end
  if (tonumber(h[1]) or -1) < 0 and in_join_grace(d, now) then return 0 end
  return (publish(d, 'barrier', now))
end

-- After a membership change: publish if the barrier is now complete, else
-- republish the published step so that routers learn of the change within
-- one snapshot. Returns the version published, 0 if none.
local function publish_after_change(d, now)
  local version = maybe_publish(d, now)
  if version == 0 then
    local pub = published_score(d)
    if pub >= 0 then version = (publish(d, pub, now)) end
  end
  return version
end
