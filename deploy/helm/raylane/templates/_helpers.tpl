{{/* Names and labels. */}}
{{- define "raylane.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "raylane.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "raylane.labels" -}}
{{ include "raylane.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{/* The Ray pods, whose Serve proxies the Service sends traffic to. */}}
{{- define "raylane.servingLabels" -}}
{{ include "raylane.selectorLabels" . }}
raylane.dev/serving: "true"
{{- end -}}

{{- define "raylane.secretName" -}}
{{ include "raylane.fullname" . }}-secrets
{{- end -}}

{{/*
A secret value as an env var: from an existing Secret (secretKeyRef) or from the chart's own
Secret (a literal value, stored there under `key`). Renders nothing when neither is set.
Arguments: (list $ ENV_NAME .Values.path.to.secret "chart-secret-key")
*/}}
{{- define "raylane.secretEnv" -}}
{{- $root := index . 0 -}}
{{- $env := index . 1 -}}
{{- $secret := index . 2 -}}
{{- $key := index . 3 -}}
{{- if $secret.secretKeyRef.name }}
- name: {{ $env }}
  valueFrom:
    secretKeyRef:
      name: {{ $secret.secretKeyRef.name }}
      key: {{ $secret.secretKeyRef.key }}
{{- else if $secret.value }}
- name: {{ $env }}
  valueFrom:
    secretKeyRef:
      name: {{ include "raylane.secretName" $root }}
      key: {{ $key }}
{{- end }}
{{- end -}}

{{/* Is a secret value set, one way or the other? */}}
{{- define "raylane.hasSecret" -}}
{{- if or .secretKeyRef.name .value -}}true{{- end -}}
{{- end -}}

{{/*
A database DSN as an env var, always from a Secret: the feature's own dsn, else postgres.dsn,
else the in-chart PostgreSQL's (in the chart's Secret); fails the render when there is none.
Arguments: (list $ ENV_NAME .Values.feature.dsn "chart-secret-key" "feature.switch")
*/}}
{{- define "raylane.dsnEnv" -}}
{{- $root := index . 0 -}}
{{- $env := index . 1 -}}
{{- $own := index . 2 -}}
{{- if include "raylane.hasSecret" $own -}}
{{ include "raylane.secretEnv" (list $root $env $own (index . 3)) }}
{{- else if include "raylane.hasSecret" $root.Values.postgres.dsn -}}
{{ include "raylane.secretEnv" (list $root $env $root.Values.postgres.dsn "postgres-dsn") }}
{{- else if $root.Values.postgres.inChart.enabled }}
- name: {{ $env }}
  valueFrom:
    secretKeyRef:
      name: {{ include "raylane.secretName" $root }}
      key: postgres-dsn
{{- else -}}
{{- fail (printf "%s needs a PostgreSQL: set its dsn (a secretKeyRef), postgres.dsn or postgres.inChart.enabled" (index . 4)) -}}
{{- end -}}
{{- end -}}

{{/* Environment of every Ray container: keys from Secrets, never from the Serve config. */}}
{{- define "raylane.env" -}}
- name: RAY_USAGE_STATS_ENABLED
  value: "0"
{{- /* Ray workers at the priority of everything else in the pod (Ray's default is nice 15):
     see WORKER_PRIORITY_ENV in cluster/launch.py */}}
- name: RAY_worker_niceness
  value: "0"
- name: HOME
  value: /home/raylane
{{- include "raylane.secretEnv" (list . "RAYLANE_API_KEYS" .Values.auth.apiKey "api-key") }}
{{- include "raylane.secretEnv" (list . "RAYLANE_ADMIN_API_KEY" .Values.auth.adminKey "admin-key") }}
{{- include "raylane.secretEnv" (list . "HF_TOKEN" .Values.hub.token "hub-token") }}
{{- if .Values.sessions.persist }}
{{- include "raylane.dsnEnv" (list . "RAYLANE_SESSIONS_DSN" .Values.sessions.dsn "sessions-dsn" "sessions.persist") }}
{{- end }}
{{- if .Values.consolidation.enabled }}
{{- include "raylane.dsnEnv" (list . "RAYLANE_CONSOLIDATION_DSN" .Values.consolidation.dsn "consolidation-dsn" "consolidation.enabled") }}
{{- end }}
{{- with .Values.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Checks no schema can express: they fail the render with what to change. */}}
{{- define "raylane.validate" -}}
{{- $tp := int .Values.serving.tensorParallelSize -}}
{{- $gpus := int .Values.workers.gpusPerWorker -}}
{{- if gt $gpus 0 -}}
{{- if .Values.serving.batchInvariant -}}
{{- fail (printf "serving.batchInvariant runs on CPU workers only for now (the engine has no batch-invariant GPU kernels yet), but workers.gpusPerWorker is %d; set it to 0 or turn batchInvariant off" $gpus) -}}
{{- end -}}
{{- if lt $gpus $tp -}}
{{- fail (printf "workers.gpusPerWorker (%d) is less than serving.tensorParallelSize (%d): a replica's shards must share one worker node; raise workers.gpusPerWorker or lower the tensor-parallel size" $gpus $tp) -}}
{{- end -}}
{{- $need := mul (int .Values.serving.replicas) $tp -}}
{{- $have := mul (int .Values.workers.maxReplicas) $gpus -}}
{{- if gt $need $have -}}
{{- fail (printf "serving.replicas x serving.tensorParallelSize = %d GPUs, but the worker group provides at most %d (workers.maxReplicas %d x workers.gpusPerWorker %d); add workers or GPUs per worker" $need $have (int .Values.workers.maxReplicas) $gpus) -}}
{{- end -}}
{{- $perNode := mul (div $gpus $tp) $tp -}}
{{- if ne $perNode $gpus -}}
{{- fail (printf "workers.gpusPerWorker (%d) is not a multiple of serving.tensorParallelSize (%d): %d GPU(s) per worker would stay idle" $gpus $tp (sub $gpus $perNode)) -}}
{{- end -}}
{{- end -}}
{{- if or (lt (int .Values.workers.maxReplicas) (int .Values.workers.replicas)) (gt (int .Values.workers.minReplicas) (int .Values.workers.replicas)) -}}
{{- fail (printf "workers: need minReplicas (%d) <= replicas (%d) <= maxReplicas (%d)" (int .Values.workers.minReplicas) (int .Values.workers.replicas) (int .Values.workers.maxReplicas)) -}}
{{- end -}}
{{- if and .Values.auth.adminKey.value (eq .Values.auth.adminKey.value .Values.auth.apiKey.value) -}}
{{- fail "auth.adminKey must differ from auth.apiKey: a user key must not open the admin routes" -}}
{{- end -}}
{{- range $name, $s := dict "auth.apiKey" .Values.auth.apiKey "auth.adminKey" .Values.auth.adminKey "postgres.dsn" .Values.postgres.dsn "sessions.dsn" .Values.sessions.dsn "consolidation.dsn" .Values.consolidation.dsn "hub.token" .Values.hub.token "postgres.inChart.password" .Values.postgres.inChart.password -}}
{{- if and $s.value $s.secretKeyRef.name -}}
{{- fail (printf "%s: set either value or secretKeyRef, not both" $name) -}}
{{- end -}}
{{- if and $s.secretKeyRef.name (not $s.secretKeyRef.key) -}}
{{- fail (printf "%s.secretKeyRef: name %q needs a key" $name $s.secretKeyRef.name) -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* The arguments of raylane.serve:app_builder (ClusterConfig fields; no secrets here). */}}
{{- define "raylane.serveArgs" -}}
{{- $engine := dict "tensor_parallel_size" (int .Values.serving.tensorParallelSize) "max_num_seqs" (int .Values.serving.maxNumSeqs) "dtype" .Values.model.dtype "enable_prefix_caching" .Values.serving.enablePrefixCaching "enable_return_routed_experts" .Values.serving.enableReturnRoutedExperts "enable_return_indexer_topk" .Values.serving.enableReturnIndexerTopk "async_scheduling" .Values.serving.asyncScheduling "batch_invariant" .Values.serving.batchInvariant -}}
{{- if gt (int .Values.model.maxModelLen) 0 -}}
{{- $_ := set $engine "max_model_len" (int .Values.model.maxModelLen) -}}
{{- end -}}
{{- with .Values.serving.speculativeConfig }}{{ $_ := set $engine "speculative_config" . }}{{ end -}}
{{- $lora := .Values.serving.lora | default dict -}}
{{- if $lora.enabled -}}
{{- $_ := set $engine "enable_lora" true -}}
{{- $_ := set $engine "max_loras" (int ($lora.maxLoras | default 4)) -}}
{{- $_ := set $engine "max_lora_rank" (int ($lora.maxLoraRank | default 16)) -}}
{{- if gt (int ($lora.maxCpuLoras | default 0)) 0 }}{{ $_ := set $engine "max_cpu_loras" (int $lora.maxCpuLoras) }}{{ end -}}
{{- else if $lora.modules -}}
{{- fail "serving.lora.modules needs serving.lora.enabled: true" -}}
{{- end -}}
{{- $args := dict "replicas" (int .Values.serving.replicas) "max_queue_per_replica" (int .Values.serving.maxQueuePerReplica) "max_body_bytes" (int .Values.serving.maxBodyBytes) "engine" $engine -}}
{{- with .Values.model.path }}{{ $_ := set $args "model" . }}{{ end -}}
{{- with .Values.model.servedModelName }}{{ $_ := set $args "served_model_name" . }}{{ end -}}
{{- with .Values.serving.toolCallParser }}{{ $_ := set $args "tool_call_parser" . }}{{ end -}}
{{- if .Values.serving.trainerApi }}{{ $_ := set $args "trainer_api" true }}{{ end -}}
{{- if and $lora.enabled $lora.modules }}{{ $_ := set $args "lora_modules" $lora.modules }}{{ end -}}
{{- if .Values.consolidation.enabled -}}
{{- $c := .Values.consolidation -}}
{{- /* no dsn: it reaches the pods as RAYLANE_CONSOLIDATION_DSN, from a Secret */ -}}
{{- $section := dict "interval_s" $c.intervalSeconds "batch_size" (int $c.batchSize) "llm_batch_size" (int $c.llmBatchSize) "max_parallel_groups" (int $c.maxParallelGroups) "max_tokens" (int $c.maxTokens) -}}
{{- with $c.banks }}{{ $_ := set $section "banks" . }}{{ end -}}
{{- with $c.model }}{{ $_ := set $section "model" . }}{{ end -}}
{{- $_ := set $args "consolidation" $section -}}
{{- end -}}
{{- toYaml $args -}}
{{- end -}}

{{/* Volumes and mounts shared by every Ray pod. */}}
{{- define "raylane.volumes" -}}
- name: tmp
  emptyDir: {}
- name: home-cache
  emptyDir: {}
{{- if .Values.modelCache.enabled }}
- name: model-cache
  persistentVolumeClaim:
    claimName: {{ .Values.modelCache.existingClaim | default (printf "%s-models" (include "raylane.fullname" .)) }}
{{- end }}
{{- end -}}

{{- define "raylane.volumeMounts" -}}
- name: tmp
  mountPath: /tmp
- name: home-cache
  mountPath: /home/raylane/.cache
{{- if .Values.modelCache.enabled }}
- name: model-cache
  mountPath: {{ .Values.modelCache.mountPath }}
{{- end }}
{{- end -}}

{{/* Probes on /health of the Serve proxy on this pod. */}}
{{- define "raylane.probes" -}}
startupProbe:
  httpGet: {path: /health, port: serve}
  periodSeconds: {{ .Values.probes.startup.periodSeconds }}
  failureThreshold: {{ .Values.probes.startup.failureThreshold }}
readinessProbe:
  httpGet: {path: /health, port: serve}
  periodSeconds: {{ .Values.probes.readiness.periodSeconds }}
  failureThreshold: {{ .Values.probes.readiness.failureThreshold }}
livenessProbe:
  httpGet: {path: /health, port: serve}
  periodSeconds: {{ .Values.probes.liveness.periodSeconds }}
  failureThreshold: {{ .Values.probes.liveness.failureThreshold }}
{{- end -}}
