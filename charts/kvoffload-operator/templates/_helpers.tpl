{{/*
Chart name, truncated to 63 characters (a DNS-1123 label).
*/}}
{{- define "kvoffload-operator.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Full name: release-chart, or the release name alone when it already holds the chart name;
truncated to 63 characters.
*/}}
{{- define "kvoffload-operator.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/*
helm.sh/chart label value.
*/}}
{{- define "kvoffload-operator.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Selector labels: name and instance only (a Deployment's selector is immutable).
*/}}
{{- define "kvoffload-operator.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvoffload-operator.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/*
Standard labels on every object of the chart.
*/}}
{{- define "kvoffload-operator.labels" -}}
helm.sh/chart: {{ include "kvoffload-operator.chart" . }}
{{ include "kvoffload-operator.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: kvoffload
{{- end }}

{{/*
ServiceAccount name.
*/}}
{{- define "kvoffload-operator.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "kvoffload-operator.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/*
Operator image (its repository, at the chart's appVersion, is the exporter sidecar's unless operator.config.exporterImage is set).
*/}}
{{- define "kvoffload-operator.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/*
The operator settings file (kvoffload/api/settings.py keys). exporterImage defaults to the operator image's
repository at the chart's appVersion, not at image.tag: the exporter is part of every serving pod, so a new
operator image alone (`--set image.tag=...`) must roll no serving pod; a new chart release rolls them once.
*/}}
{{- define "kvoffload-operator.config" -}}
{{- $cfg := deepCopy .Values.operator.config }}
{{- if not $cfg.exporterImage }}
{{- $_ := set $cfg "exporterImage" (printf "%s:%s" .Values.image.repository .Chart.AppVersion) }}
{{- end }}
{{- $_ := set $cfg "operatorNamespace" .Release.Namespace }}
{{- if hasKey $cfg "pythonHashSeed" }}
{{- $_ := set $cfg "pythonHashSeed" (toString $cfg.pythonHashSeed) }}
{{- end }}
{{- toYaml $cfg }}
{{- end }}

{{/*
Namespace selector for monitors: the watched namespaces, or any.
*/}}
{{- define "kvoffload-operator.monitorNamespaceSelector" -}}
{{- if .Values.watchNamespaces }}
matchNames:
  {{- toYaml .Values.watchNamespaces | nindent 2 }}
{{- else }}
any: true
{{- end }}
{{- end }}

{{/*
RBAC rules: exactly what the operator calls (kvoffload/controller/: cache.py, kube.py, reconcile.py). No
wildcards, no Secrets (a Hugging Face token is referenced by name in the pod spec, never read).
*/}}
{{- define "kvoffload-operator.rules" -}}
# Watch KVOffloadServes into the operator's cache (list + watch; no get: reconciles read the
# cache). No patch: the operator keeps no finalizer or annotation on them
# (tests/integration/test_chart_rbac.py proves it).
- apiGroups: ["kvoffload.io"]
  resources: ["kvoffloadserves"]
  verbs: ["list", "watch"]
# Conditions and the computed budget.
- apiGroups: ["kvoffload.io"]
  resources: ["kvoffloadserves/status"]
  verbs: ["patch"]
# Children: server-side apply (PATCH; create for new objects), prune, list/watch into the cache. No get: the cache
# watches these kinds whole, so the check that refuses a name another owner holds (NameConflict) reads it there.
- apiGroups: [""]
  resources: ["configmaps", "services"]
  verbs: ["list", "watch", "create", "patch", "delete"]
- apiGroups: ["apps"]
  resources: ["statefulsets"]
  verbs: ["list", "watch", "create", "patch", "delete"]
# spec.routing: the router's Deployment, and its ServiceAccount bound to a Role that lists and watches pods in the
# resource's namespace (the operator may grant that Role because it holds pods list/watch itself, below).
- apiGroups: ["apps"]
  resources: ["deployments"]
  verbs: ["list", "watch", "create", "patch", "delete"]
- apiGroups: [""]
  resources: ["serviceaccounts"]
  verbs: ["list", "watch", "create", "patch", "delete"]
- apiGroups: ["rbac.authorization.k8s.io"]
  resources: ["roles", "rolebindings"]
  verbs: ["list", "watch", "create", "patch", "delete"]
- apiGroups: ["policy"]
  resources: ["poddisruptionbudgets"]
  verbs: ["list", "watch", "create", "patch", "delete"]
# spec.networkPolicy: one NetworkPolicy per KVOffloadServe that asks for it.
- apiGroups: ["networking.k8s.io"]
  resources: ["networkpolicies"]
  verbs: ["list", "watch", "create", "patch", "delete"]
# spec.autoscaling: the HorizontalPodAutoscaler (or, with autoscaler keda or auto, the ScaledObject whose HPA
# KEDA makes and the operator reads into status.autoscaling), list/watch into the cache. What is served (custom
# and external metrics APIs, keda.sh) is read from discovery, which needs no rule (system:discovery).
- apiGroups: ["autoscaling"]
  resources: ["horizontalpodautoscalers"]
  verbs: ["list", "watch", "create", "patch", "delete"]
{{- /* auto picks KEDA only with a prometheusAddress (settings.resolve_autoscaler): grant it only then */}}
{{- $c := .Values.operator.config }}
{{- if or (eq $c.autoscaler "keda") (and (eq $c.autoscaler "auto") $c.prometheusAddress) }}
- apiGroups: ["keda.sh"]
  resources: ["scaledobjects"]
  verbs: ["list", "watch", "create", "patch", "delete"]
{{- end }}
# Pods drive the Scheduled and Ready conditions (list/watch into the cache).
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["list", "watch"]
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create"]
{{- end }}
