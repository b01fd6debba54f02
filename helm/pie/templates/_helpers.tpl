{{/* Names, labels, the TOML rendering of config.toml, and the Ray pod pieces the RayCluster repeats. */}}

{{- define "pie.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "pie.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "pie.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag }}
{{- end -}}

{{/* The Secret holding [auth.tokens]: the user's own, or the one this chart makes. */}}
{{- define "pie.authSecret" -}}
{{- .Values.auth.existingSecret | default (printf "%s-auth" (include "pie.fullname" .)) -}}
{{- end -}}

{{/* A TOML key: bare when TOML allows it, else quoted. */}}
{{- define "pie.tomlKey" -}}
{{- if regexMatch "^[A-Za-z0-9_-]+$" . -}}{{ . }}{{- else -}}{{ toJson . }}{{- end -}}
{{- end -}}

{{/* A TOML value: maps become inline tables, lists arrays; JSON strings, numbers and booleans are valid TOML. */}}
{{- define "pie.tomlValue" -}}
{{- if kindIs "map" . -}}
{ {{- range $i, $k := keys . | sortAlpha }}{{ if $i }},{{ end }} {{ include "pie.tomlKey" $k }} = {{ include "pie.tomlValue" (get $ $k) }}{{ end }} }
{{- else if kindIs "slice" . -}}
[{{ range $i, $v := . }}{{ if $i }}, {{ end }}{{ include "pie.tomlValue" $v }}{{ end }}]
{{- else -}}
{{ toJson . }}
{{- end -}}
{{- end -}}

{{/* The key = value lines of one TOML table; null values are left out (PieConfig's default applies). */}}
{{- define "pie.tomlPairs" -}}
{{- range $k, $v := . }}
{{- if not (kindIs "invalid" $v) }}
{{ include "pie.tomlKey" $k }} = {{ include "pie.tomlValue" $v }}
{{- end }}
{{- end }}
{{- end -}}

{{/* config.toml without [auth.tokens], which the head appends from the Secret. */}}
{{- define "pie.configToml" -}}
# config.toml for `pie start` (PieConfig, cluster/pie_cluster/config.py), rendered by the pie Helm chart.
[server]
host = "0.0.0.0"
port = {{ .Values.service.port }}
{{- include "pie.tomlPairs" .Values.pie.server }}

[auth]
enabled = {{ .Values.auth.enabled }}

{{- with .Values.pie.launcher }}

[launcher]
{{- include "pie.tomlPairs" . }}
{{- end }}
{{- with .Values.pie.bus }}

[bus]
{{- include "pie.tomlPairs" . }}
{{- end }}
{{- range .Values.pie.models }}

[[model]]
{{- include "pie.tomlPairs" . }}
{{- end }}
{{- range $name, $server := .Values.pie.mcp }}

[mcp.{{ include "pie.tomlKey" $name }}]
{{- include "pie.tomlPairs" $server }}
{{- end }}
{{- end -}}

{{/* The [auth.tokens] table, kept in the Secret. */}}
{{- define "pie.tokensToml" -}}
[auth.tokens]
{{- range $token, $user := .Values.auth.tokens }}
{{ toJson $token }} = {{ toJson $user }}
{{- end }}
{{- end -}}

{{/* Shell lines that build the embedded models the [[model]] entries use, so every pod has them at one path. */}}
{{- define "pie.buildModels" -}}
{{- $lines := list -}}
{{- range .Values.pie.models -}}
{{- if not .path -}}
{{- $lines = append $lines (printf "pie model build-default --arch %s >/dev/null" (.arch | default "llama")) -}}
{{- end -}}
{{- end -}}
{{- $lines | uniq | join "\n" -}}
{{- end -}}

{{/* What every Ray pod mounts: /dev/shm for the object store, and the model volume if there is one. */}}
{{- define "pie.podVolumes" -}}
- name: shm
  emptyDir: {medium: Memory, sizeLimit: {{ .Values.sharedMemory }}}
{{- with .Values.modelVolume }}
- name: models
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{- define "pie.podVolumeMounts" -}}
- {name: shm, mountPath: /dev/shm}
{{- if .Values.modelVolume }}
- {name: models, mountPath: {{ .Values.modelMountPath }}, readOnly: true}
{{- end }}
{{- end -}}

{{/* A worker group's bounds: minReplicas and maxReplicas, `replicas` where unset (0 is a bound, not unset). */}}
{{- define "pie.groupMin" -}}
{{- if kindIs "invalid" .minReplicas }}{{ .replicas }}{{ else }}{{ .minReplicas }}{{ end -}}
{{- end -}}
{{- define "pie.groupMax" -}}
{{- if kindIs "invalid" .maxReplicas }}{{ .replicas }}{{ else }}{{ .maxReplicas }}{{ end -}}
{{- end -}}

{{/* Whether a worker group is rendered: it has pods, or the autoscaler may give it some. */}}
{{- define "pie.groupUsed" -}}
{{- if or (gt (int .group.replicas) 0) (and .root.Values.autoscaling.enabled (gt (int (include "pie.groupMax" .group)) 0)) }}yes{{ end -}}
{{- end -}}

{{/* One KubeRay worker group, between its bounds; `gpus` adds nvidia.com/gpu to its limits. */}}
{{- define "pie.workerGroup" -}}
{{- $min := int (include "pie.groupMin" .group) -}}
{{- $max := int (include "pie.groupMax" .group) -}}
{{- if not (and (le $min (int .group.replicas)) (le (int .group.replicas) $max)) -}}
{{- fail (printf "%sWorkers: minReplicas (%d) <= replicas (%d) <= maxReplicas (%d) does not hold" .name $min (int .group.replicas) $max) -}}
{{- end -}}
{{- $resources := deepCopy .group.resources -}}
{{- if .gpus -}}
{{- $_ := set $resources "limits" (merge (dict "nvidia.com/gpu" (int .gpus)) ($resources.limits | default dict)) -}}
{{- end -}}
- groupName: {{ .name }}
  replicas: {{ .group.replicas }}
  minReplicas: {{ $min }}
  maxReplicas: {{ $max }}
  rayStartParams: {}
  template:
    metadata:
      labels:
        {{- include "pie.labels" .root | nindent 8 }}
    spec:
      {{- with .root.Values.imagePullSecrets }}
      imagePullSecrets:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with .group.nodeSelector }}
      nodeSelector:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with .group.tolerations }}
      tolerations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      containers:
        - name: ray-worker
          image: {{ include "pie.image" .root }}
          imagePullPolicy: {{ .root.Values.image.pullPolicy }}
          command: ["/bin/bash", "-lc", "--"]
          args:
            - |
              ulimit -n 65536
              {{- with include "pie.buildModels" .root }}{{ . | nindent 14 }}{{ end }}
              exec $KUBERAY_GEN_RAY_START_CMD
          lifecycle:
            preStop:
              exec:
                command: ["/bin/bash", "-lc", "pie drain --this-node --timeout {{ .root.Values.drainTimeoutSeconds }} || true"]
          resources:
            {{- toYaml $resources | nindent 12 }}
          volumeMounts:
            {{- include "pie.podVolumeMounts" .root | nindent 12 }}
      terminationGracePeriodSeconds: {{ add (int .root.Values.drainTimeoutSeconds) 30 }}
      volumes:
        {{- include "pie.podVolumes" .root | nindent 8 }}
{{- end -}}
