-- Argo CD health check for kvoffload.io/KVOffloadServe
-- (argocd-cm key: resource.customizations.health.kvoffload.io_KVOffloadServe).
-- Reads only the status the kvoffload operator writes. Runs without Lua's standard libraries
-- (Argo CD's default for argocd-cm scripts): base and table functions only.
--   Degraded     the spec cannot be acted on (Stalled / ConfigValid=False), or pods cannot run
--   Suspended    spec.replicas is 0 and the operator has reconciled that
--   Healthy      Ready=True, observed at the current generation
--   Progressing  anything else: not yet seen by the operator, rolling out, pods starting
local hs = {}
local generation = obj.metadata.generation
local status = obj.status or {}
local conditions = {}
for _, c in ipairs(status.conditions or {}) do
  -- A condition computed from an older generation says nothing about the current spec.
  if c.observedGeneration == nil or generation == nil or c.observedGeneration == generation then
    conditions[c.type] = c
  end
end

local function says(c)
  if c.message ~= nil and c.message ~= "" then
    return (c.reason or c.type) .. ": " .. c.message
  end
  return c.reason or c.type
end

local stalled, valid, ready = conditions.Stalled, conditions.ConfigValid, conditions.Ready
if stalled ~= nil and stalled.status == "True" then
  hs.status = "Degraded"
  hs.message = "Spec refused, " .. says(stalled)
  return hs
end
if valid ~= nil and valid.status == "False" then
  hs.status = "Degraded"
  hs.message = "Spec refused, " .. says(valid)
  return hs
end
if ready ~= nil and ready.status == "False" and (ready.reason == "Unschedulable" or ready.reason == "PodsFailing") then
  hs.status = "Degraded"
  hs.message = says(ready)
  return hs
end
if ready == nil then
  hs.status = "Progressing"
  if status.conditions == nil then
    hs.message = "Waiting for the kvoffload operator's first status"
  else
    hs.message = "Waiting for the kvoffload operator to observe generation " .. tostring(generation)
  end
  return hs
end
if ready.status == "True" and status.observedGeneration == generation then
  if obj.spec ~= nil and obj.spec.replicas == 0 then
    hs.status = "Suspended"
    hs.message = "Scaled to zero replicas"
    return hs
  end
  hs.status = "Healthy"
  hs.message = ready.message
  return hs
end
local reconciling = conditions.Reconciling
hs.status = "Progressing"
if reconciling ~= nil and reconciling.status == "True" then
  hs.message = says(reconciling)
else
  hs.message = says(ready)
end
return hs
