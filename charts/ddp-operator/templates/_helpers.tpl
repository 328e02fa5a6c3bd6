{{/* The chart name, or nameOverride. */}}
{{- define "ddp-operator.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* `<release>-<chart>`, shortened to a DNS label; the release name alone when it already holds the chart name. */}}
{{- define "ddp-operator.fullname" -}}
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

{{- define "ddp-operator.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels of the operator's own objects. Never `app.kubernetes.io/managed-by: ddp-operator`: that one marks a DDPJob's children. */}}
{{- define "ddp-operator.labels" -}}
helm.sh/chart: {{ include "ddp-operator.chart" . }}
{{ include "ddp-operator.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "ddp-operator.selectorLabels" -}}
app.kubernetes.io/name: {{ include "ddp-operator.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end }}

{{- define "ddp-operator.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "ddp-operator.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name must name an existing ServiceAccount when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "ddp-operator.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/* Cluster-wide mode: no watchNamespaces. */}}
{{- define "ddp-operator.clusterwide" -}}
{{- if not .Values.watchNamespaces }}true{{ end }}
{{- end }}

{{/*
The verbs the operator itself uses on DDPJobs and their children (ddp_operator/kube_api.py and kopf's
watches); the same rules go into the ClusterRole (cluster-wide) or each namespace's Role.
*/}}
{{- define "ddp-operator.operatorRules" -}}
# kopf lists and watches DDPJobs; the controller deletes a finished one when its TTL has passed.
# get: whether a Kueue group's job is really gone before its Kueue Workload is deleted.
- apiGroups: ["ddp.dev"]
  resources: ["ddpjobs"]
  verbs: ["list", "watch", "delete", "get"]
# The controller writes phase, conditions and counters through the status subresource.
- apiGroups: ["ddp.dev"]
  resources: ["ddpjobs/status"]
  verbs: ["patch"]
# Children carry a controller ownerReference with blockOwnerDeletion: true; where the
# OwnerReferencesPermissionEnforcement admission plugin is on, setting it takes update on the owner's
# finalizers subresource (nothing ever writes a finalizer).
- apiGroups: ["ddp.dev"]
  resources: ["ddpjobs/finalizers"]
  verbs: ["update"]
# Rank pods: created per attempt, deleted for a gang restart, watched by label; get after a 409. patch:
# drop Kueue's finalizer from an old pod Kueue would still count, mark a failed Kueue group
# retriable-in-group "false", write a bound pod's rank order key (docs/scheduling.md).
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["create", "delete", "get", "list", "watch", "patch"]
# A standby pod that took a rank gets the rank's CPU request back in place (--standby-waiting-cpu).
- apiGroups: [""]
  resources: ["pods/resize"]
  verbs: ["patch"]
# The headless Service and the checkpoint PVC: created once (get checks an existing one is ours);
# the Service's ports are patched when a job resumes with new ones.
- apiGroups: [""]
  resources: ["services"]
  verbs: ["create", "get", "patch"]
- apiGroups: [""]
  resources: ["persistentvolumeclaims"]
  verbs: ["create", "get"]
# One NetworkPolicy per job (its rank pods admit their own job and Prometheus): created once, get checks
# an existing one is ours, patched when the metrics port or --metrics-allow-from changed.
- apiGroups: ["networking.k8s.io"]
  resources: ["networkpolicies"]
  verbs: ["create", "get", "patch"]
# The in-tree gang (scheduling.k8s.io, Kubernetes 1.36+, when served): one Workload and one PodGroup per
# attempt, created before its pods, read back after a 409, deleted with the attempt.
- apiGroups: ["scheduling.k8s.io"]
  resources: ["workloads", "podgroups"]
  verbs: ["create", "get", "list", "delete"]
# Kueue (when installed): read why a queued job waits (its group's Workload, its LocalQueue), and delete
# the group's Workload when the job is deleted, so Kueue frees the quota and the pods' finalizers.
- apiGroups: ["kueue.x-k8s.io"]
  resources: ["workloads"]
  verbs: ["get", "delete"]
- apiGroups: ["kueue.x-k8s.io"]
  resources: ["localqueues"]
  verbs: ["get"]
# One Event per phase change.
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create"]
{{- end }}

{{/* The PriorityClass of standby pods (`--standby-priority-class`): the value's name, else `<fullname>-standby` when the chart creates it, else none (standbys keep their template's class). */}}
{{- define "ddp-operator.standbyPriorityClass" -}}
{{- if .Values.standbyPriorityClass.name }}
{{- .Values.standbyPriorityClass.name }}
{{- else if .Values.standbyPriorityClass.create }}
{{- printf "%s-standby" (include "ddp-operator.fullname" .) }}
{{- end }}
{{- end }}
