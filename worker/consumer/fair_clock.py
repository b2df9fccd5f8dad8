"""The fair clocks start again from 0 whenever a model has no job with a backlog.

Dispatch (dispatch.py) keeps, in the model's ``fair`` hash, the clock (``clock``),
each tenant's virtual time (``t:TENANT``: tokens charged over its weight) and each
tenant's job clock (``c:TENANT``). They only order the jobs competing at one time:
once no job has a backlog nothing competes, and a tenant or job that gets work
again would be raised to the clock anyway. So the moment the last backlog is
emptied (or the first time dispatch finds none) they are dropped, and whatever
they had reached during the busy period (a tenant of the smallest weight running
alone moves them by a thousand times its tokens) does not outlive it: a value so
large that adding a request's cost leaves it unchanged would make every weight
count alike. The weights (``w:TENANT``) and the fleet's rate stay.
"""

from __future__ import annotations

# Lua, for dispatch's prelude: rest_fair_clocks(fair) drops the clocks (one HEXISTS
# when there are none, so an idle worker's polls cost next to nothing).
REST_FAIR_CLOCKS = """
local function rest_fair_clocks(fair)
  if redis.call('HEXISTS', fair, 'clock') == 0 then return end
  for _, field in ipairs(redis.call('HKEYS', fair)) do
    local kind = string.sub(field, 1, 2)
    if field == 'clock' or field == 'urgent_debt' or kind == 't:' or kind == 'c:' then
      redis.call('HDEL', fair, field)
    end
  end
end
"""
