{{/* Names, labels and the pieces every template shares. */}}

{{- define "appliance.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "appliance.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else if contains (include "appliance.name" .) .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name (include "appliance.name" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "appliance.selectorLabels" -}}
app.kubernetes.io/name: {{ include "appliance.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "appliance.labels" -}}
{{ include "appliance.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{- define "appliance.image" -}}
{{- printf "%s:%s" .repository .tag -}}
{{- end -}}

{{- define "appliance.otaImage" -}}
{{- $image := merge (deepCopy .Values.ota.image) .Values.image -}}
{{- include "appliance.image" $image -}}
{{- end -}}

{{/* the container's memory: the models' budget plus the server's own share */}}
{{- define "appliance.memory" -}}
{{- add .Values.memory.modelsMiB .Values.memory.serverMiB }}Mi
{{- end -}}

{{- define "appliance.validate" -}}
{{- if not (has .Values.kind (list "Deployment" "DaemonSet")) -}}
{{- fail "kind: Deployment or DaemonSet" -}}
{{- end -}}
{{- if not (has .Values.platform (list "x86" "jetson")) -}}
{{- fail "platform: x86 or jetson" -}}
{{- end -}}
{{- if not (has .Values.modelRepository.source (list "persistentVolumeClaim" "hostPath" "ota")) -}}
{{- fail "modelRepository.source: persistentVolumeClaim, hostPath or ota" -}}
{{- end -}}
{{- if and (eq .Values.modelRepository.source "ota") (not .Values.ota.enabled) -}}
{{- fail "modelRepository.source ota needs ota.enabled" -}}
{{- end -}}
{{- if and .Values.ota.enabled (not .Values.server.adminToken) -}}
{{- fail "ota.enabled needs server.adminToken (the agent's admin calls)" -}}
{{- end -}}
{{- if and (eq .Values.platform "jetson") (gt (int .Values.gpu.count) 0) -}}
{{- fail "gpu.count is for discrete GPUs (x86): Jetson's GPU comes with its runtime class" -}}
{{- end -}}
{{- end -}}
