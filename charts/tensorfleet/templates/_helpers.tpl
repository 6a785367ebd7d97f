{{/*
Names, labels and the image references shared by the templates.
*/}}

{{/* The chart's name, or nameOverride. */}}
{{- define "tensorfleet.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
The release's name for its objects: fullnameOverride, else the release name when it already
contains the chart name, else "<release>-<chart>"; 63 characters at most (a DNS label).
*/}}
{{- define "tensorfleet.fullname" -}}
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

{{/* "<chart>-<version>", for the helm.sh/chart label. */}}
{{- define "tensorfleet.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels of every object. */}}
{{- define "tensorfleet.labels" -}}
helm.sh/chart: {{ include "tensorfleet.chart" . }}
{{ include "tensorfleet.selectorLabels" . }}
{{- if .Chart.AppVersion }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
{{- end }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: tensorfleet
{{- end }}

{{/* The labels that select the operator's pods; they never change across upgrades. */}}
{{- define "tensorfleet.selectorLabels" -}}
app.kubernetes.io/name: {{ include "tensorfleet.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end }}

{{/* The same labels as key=value,… (the operator's TENSORFLEET_POD_SELECTOR). */}}
{{- define "tensorfleet.selectorList" -}}
{{- $pairs := list }}
{{- range $k, $v := include "tensorfleet.selectorLabels" . | fromYaml }}
{{- $pairs = append $pairs (printf "%s=%s" $k $v) }}
{{- end }}
{{- join "," $pairs }}
{{- end }}

{{/* The operator's ServiceAccount. */}}
{{- define "tensorfleet.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "tensorfleet.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/*
An image reference from {repository, tag, digest}: the digest wins, and an empty tag means the
chart's appVersion. Call with (dict "image" .Values.image "context" $).
*/}}
{{- define "tensorfleet.imageRef" -}}
{{- $image := .image }}
{{- if $image.digest }}
{{- printf "%s@%s" $image.repository $image.digest }}
{{- else }}
{{- printf "%s:%s" $image.repository (default .context.Chart.AppVersion $image.tag) }}
{{- end }}
{{- end }}

{{/* The operator's image. */}}
{{- define "tensorfleet.image" -}}
{{- include "tensorfleet.imageRef" (dict "image" .Values.image "context" .) }}
{{- end }}

{{/* The worker image a TrainingJob names in spec.image (printed by NOTES.txt). */}}
{{- define "tensorfleet.workerImage" -}}
{{- include "tensorfleet.imageRef" (dict "image" .Values.workerImage "context" .) }}
{{- end }}

{{/* The leader-election Lease. */}}
{{- define "tensorfleet.leaseName" -}}
{{- default (include "tensorfleet.fullname" .) .Values.leaderElection.leaseName }}
{{- end }}

{{/* The watched namespaces as a list without empty entries (empty list: all namespaces). */}}
{{- define "tensorfleet.watchNamespaces" -}}
{{- $namespaces := list }}
{{- range .Values.watchNamespaces }}
{{- if . }}
{{- $namespaces = append $namespaces (. | toString) }}
{{- end }}
{{- end }}
{{- toJson ($namespaces | uniq) }}
{{- end }}

{{/*
What the operator does to TrainingJobs and their children, in the namespaces it watches; the
same rules go into a ClusterRole (all namespaces) or into one Role per watched namespace.
Every verb here is one the controller calls (operator/src/controller.rs).
*/}}
{{- define "tensorfleet.operatorRules" -}}
# Watch jobs and delete them when ttlSecondsAfterFinished runs out; the spec is the user's.
- apiGroups: ["tensorfleet.dev"]
  resources: ["trainingjobs"]
  verbs: ["get", "list", "watch", "delete"]
# The status, by server-side apply.
- apiGroups: ["tensorfleet.dev"]
  resources: ["trainingjobs/status"]
  verbs: ["get", "patch"]
# Children carry an owner reference with blockOwnerDeletion, which clusters running the
# OwnerReferencesPermissionEnforcement admission plugin (OpenShift among them) allow only to
# whoever may update the owner's finalizers. The operator sets no finalizers itself.
- apiGroups: ["tensorfleet.dev"]
  resources: ["trainingjobs/finalizers"]
  verbs: ["update"]
# Launcher and worker pods: created and deleted whole, never patched.
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["get", "list", "watch", "create", "delete"]
# The headless Service and the ConfigMap (hostfile, train.yaml), by server-side apply.
- apiGroups: [""]
  resources: ["services", "configmaps"]
  verbs: ["get", "list", "watch", "create", "patch"]
# The per-job SSH key Secret: looked up by name and created once; never listed or watched.
- apiGroups: [""]
  resources: ["secrets"]
  verbs: ["get", "create"]
# The checkpoint claim: looked up by name and created once.
- apiGroups: [""]
  resources: ["persistentvolumeclaims"]
  verbs: ["get", "create"]
# The NetworkPolicy of a job with spec.networkPolicy.enabled, by server-side apply; deleted
# when the job turns it off (status.networkPolicy says one was made).
- apiGroups: ["networking.k8s.io"]
  resources: ["networkpolicies"]
  verbs: ["create", "patch", "delete"]
# Kubernetes events about jobs (events.k8s.io/v1; patch updates a repeated event's series).
- apiGroups: ["events.k8s.io"]
  resources: ["events"]
  verbs: ["create", "patch"]
{{- if .Values.gangScheduler.volcano }}
# Volcano PodGroups (spec.scheduling.gang: Volcano), by server-side apply.
- apiGroups: ["scheduling.volcano.sh"]
  resources: ["podgroups"]
  verbs: ["get", "create", "patch"]
{{- end }}
{{- if .Values.gangScheduler.schedulerPlugins }}
# scheduler-plugins coscheduling PodGroups (spec.scheduling.gang: SchedulerPlugins).
- apiGroups: ["scheduling.x-k8s.io"]
  resources: ["podgroups"]
  verbs: ["get", "create", "patch"]
{{- end }}
{{- end }}
