# usage: bash tools/device/lease.sh NAME:LIMIT_S [NAME:LIMIT_S ...]   runs .gpu/NAME.sh in order, each under timeout
source "$(dirname "$0")/setup.sh"
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
mkdir -p $OUT/logs
for spec in "$@"; do
  name=${spec%%:*}; limit=${spec##*:}
  mkdir -p /tmp/res/$name.d
  echo "=== $name (limit $limit s) $(date +%T)"
  t0=$(date +%s)
  OUT=/tmp/res/$name.d LIMIT_S=$limit timeout -k 10 $limit bash .gpu/$name.sh > /tmp/res/$name.log 2>&1
  echo "=== $name rc=$? $(( $(date +%s) - t0 )) s"
  tail -c ${TAIL:-1500} /tmp/res/$name.log
done
tar czf $OUT/results.tgz -C /tmp/res . 2>/dev/null
ls -la $OUT
