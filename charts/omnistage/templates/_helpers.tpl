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

{{/* The selector labels as one KEY=VALUE,... argument (sorted by key), for --operator-pod-labels. */}}
{{- define "omnistage.selectorLabelsArg" -}}
{{- $pairs := list -}}
{{- range $key, $value := include "omnistage.selectorLabels" . | fromYaml -}}
{{- $pairs = append $pairs (printf "%s=%s" $key $value) -}}
{{- end -}}
{{- join "," $pairs -}}
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

{{- define "omnistage.webhookService" -}}
{{- printf "%s-webhook" (include "omnistage.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "omnistage.webhookCertSecret" -}}
{{- printf "%s-webhook-tls" (include "omnistage.fullname" .) -}}
{{- end -}}

{{- define "omnistage.leaseName" -}}
{{- default (include "omnistage.fullname" .) .Values.leaderElection.leaseName -}}
{{- end -}}

{{- /*
Least privilege: one rule per thing the operator manages, and why. It reads through list+watch
caches (its only plain get reads an aggregated Event's count after a restart) and leaves deleting
its children to the garbage collector (they carry ownerReferences); it deletes only replica Pods
and StagePools itself. tests/e2e/test_chart_rbac.py
runs the operator with exactly this ServiceAccount and fails on any 403 or on a grant it never uses.
*/}}
{{- define "omnistage.rules" -}}
# Its pipelines: watched, and patched for the ordered-shutdown finalizer.
- apiGroups: [omnistage.io]
  resources: [omnipipelines]
  verbs: [list, watch, patch]
# StagePools: one per stage, created, kept as desired, deleted when their stage goes.
- apiGroups: [omnistage.io]
  resources: [stagepools]
  verbs: [list, watch, create, patch, delete]
# The autoscaler writes a pool's size as `kubectl scale` does, reads each orchestrator's load
# (GET /v1/load) through its Service's proxy, and refuses pools an HPA already scales.
- apiGroups: [omnistage.io]
  resources: [stagepools/scale]
  verbs: [patch]
- apiGroups: [""]
  resources: [services/proxy]
  verbs: [get]
- apiGroups: [autoscaling]
  resources: [horizontalpodautoscalers]
  verbs: [list]
# Status conditions, counts and the endpoint.
- apiGroups: [omnistage.io]
  resources: [omnipipelines/status, stagepools/status]
  verbs: [patch]
# Setting ownerReferences with blockOwnerDeletion needs update on the owner's finalizers (the
# OwnerReferencesPermissionEnforcement admission plugin checks it; it is not a request).
- apiGroups: [omnistage.io]
  resources: [omnipipelines/finalizers, stagepools/finalizers]
  verbs: [update]
# Replica pods: created and deleted one by one, patched with the drain mark; a deleting
# pipeline's stage pods in one delete-collection (by its labels). list/watch are also what the
# orchestrators' Roles grant, and RBAC only lets the operator grant what it holds.
- apiGroups: [""]
  resources: [pods]
  verbs: [list, watch, create, patch, delete, deletecollection]
# The readiness gate omnistage.io/routable is a pod status condition the operator sets.
- apiGroups: [""]
  resources: [pods/status]
  verbs: [patch]
# The orchestrator's Service, ServiceAccount and ConfigMap (the resolved spec), its Deployment,
# its namespaced Role and RoleBinding (pods list/watch), and one PodDisruptionBudget per
# StagePool: created, and patched back when they drift. A deleting pipeline's budgets are
# deleted before its stage pods (the garbage collector takes the rest).
- apiGroups: [""]
  resources: [services, configmaps, serviceaccounts]
  verbs: [list, watch, create, patch]
- apiGroups: [apps]
  resources: [deployments]
  verbs: [list, watch, create, patch]
- apiGroups: [policy]
  resources: [poddisruptionbudgets]
  verbs: [list, watch, create, patch, delete]
- apiGroups: [rbac.authorization.k8s.io]
  resources: [roles, rolebindings]
  verbs: [list, watch, create, patch]
# Each pipeline's two NetworkPolicies, over its stage pods and its orchestrator pods
# (networkPolicy.enabled): created, and patched back when they drift; the garbage collector
# deletes them with their pipeline. Watched with networkPolicy.enabled=false too.
- apiGroups: [networking.k8s.io]
  resources: [networkpolicies]
  verbs: [list, watch, create, patch]
# Each pipeline's CurveZMQ keypair (omnistage.curve) and the API-key Secret of a pipeline that
# names none: created once, with keys made at that moment, and mounted by its pods. patch: a
# CurveZMQ key rotation adds the new pair and later drops the old one with merge patches.
# Never read, listed or deleted by the operator (the garbage collector deletes them with their
# pipeline): the operator cannot read any Secret.
- apiGroups: [""]
  resources: [secrets]
  verbs: [create, patch]
# Events: created, scale, unschedulable, replica lost. Repeats are aggregated on one Event:
# patch counts one more; get reads the count back when a restarted operator finds the event
# exists (409 on create).
- apiGroups: [""]
  resources: [events]
  verbs: [create, get, patch]
{{- end -}}

{{- /*
The validating admission webhook: kopf creates its configuration once (try-create, 409 when it
exists) and keeps it current (Service or URL, caBundle). The configuration is cluster-scoped, so
these rules are cluster-wide in both watch scopes; create cannot be limited by name, patch is.
*/}}
{{- define "omnistage.webhookRules" -}}
# The admission webhook's configuration: kopf try-creates it (409 once it exists) and patches
# its webhooks; patch is limited to that one name, create cannot be.
- apiGroups: [admissionregistration.k8s.io]
  resources: [validatingwebhookconfigurations]
  verbs: [create]
- apiGroups: [admissionregistration.k8s.io]
  resources: [validatingwebhookconfigurations]
  resourceNames: [validation.omnistage.io]
  verbs: [patch]
{{- end -}}

{{/* The Secret holding the operator's root admin key: the chart's own, or adminKey.existingSecret. */}}
{{- define "omnistage.adminKeySecret" -}}
{{- default (printf "%s-admin-key" (include "omnistage.fullname" .)) .Values.adminKey.existingSecret -}}
{{- end -}}
