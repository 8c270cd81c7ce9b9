{{/* Names and labels shared by every template. */}}

{{- define "omnistage.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* <release>-operator, e.g. omnistage-operator for `helm install omnistage ...`. */}}
{{- define "omnistage.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-operator" .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "omnistage.selectorLabels" -}}
app.kubernetes.io/name: {{ include "omnistage.name" . }}-operator
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "omnistage.labels" -}}
{{ include "omnistage.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/part-of: omnistage
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{- define "omnistage.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "omnistage.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "omnistage.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{- define "omnistage.leaseName" -}}
{{- default (include "omnistage.fullname" .) .Values.leaderElection.leaseName -}}
{{- end -}}

{{- /*
Least privilege: one rule per thing the operator manages, and why. tests/chart/test_rbac.py runs
the operator with exactly this ServiceAccount and fails on any 403 or on a verb it never uses.
*/}}
{{- define "omnistage.rules" -}}
# Its own resources: OmniPipelines (reconciled) and StagePools (created per stage, reconciled).
- apiGroups: [omnistage.io]
  resources: [omnipipelines, stagepools]
  verbs: [get, list, watch, create, update, patch, delete]
# Status conditions, counts and the endpoint.
- apiGroups: [omnistage.io]
  resources: [omnipipelines/status, stagepools/status]
  verbs: [get, update, patch]
# Ordered shutdown runs through a finalizer; setting ownerReferences with blockOwnerDeletion
# also needs update on the owner's finalizers (the OwnerReferencesPermissionEnforcement
# admission plugin checks it).
- apiGroups: [omnistage.io]
  resources: [omnipipelines/finalizers, stagepools/finalizers]
  verbs: [update]
# Replica pods: created and deleted one by one, patched with the drain mark. list/watch are
# also what the orchestrators' Roles grant, and RBAC only lets the operator grant verbs it
# holds itself.
- apiGroups: [""]
  resources: [pods]
  verbs: [get, list, watch, create, patch, delete]
# The readiness gate omnistage.io/routable is a pod status condition the operator sets.
- apiGroups: [""]
  resources: [pods/status]
  verbs: [patch]
# Orchestrator Service and ServiceAccount, the ConfigMap with the resolved spec.
- apiGroups: [""]
  resources: [services, configmaps, serviceaccounts]
  verbs: [get, list, watch, create, patch, delete]
# The orchestrator Deployment.
- apiGroups: [apps]
  resources: [deployments]
  verbs: [get, list, watch, create, patch, delete]
# One PodDisruptionBudget per StagePool.
- apiGroups: [policy]
  resources: [poddisruptionbudgets]
  verbs: [get, list, watch, create, patch, delete]
# The orchestrator's namespaced Role (pods list/watch) and its RoleBinding.
- apiGroups: [rbac.authorization.k8s.io]
  resources: [roles, rolebindings]
  verbs: [get, list, watch, create, patch, delete]
# Events: create, scale, unschedulable, replica lost (kopf posts core events; both APIs allowed).
- apiGroups: [""]
  resources: [events]
  verbs: [create, patch]
- apiGroups: [events.k8s.io]
  resources: [events]
  verbs: [create, patch]
{{- end -}}
