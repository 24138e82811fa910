#!/bin/bash
# On the GPU host (device `run`), from the checkout root, with .gpu/ carried: bench/ = benchmarks/gpu/*.py, operator/,
# rendered/, oci/, crun/ (Debian crun 1.8.1 + its libraries), dev/ = this directory; .gpupN/ = one wheel-site part each.
#   bash .gpu/dev/dev.sh stash N         move .gpupN/site.part* out of the checkout (kept while the machine is warm)
#   bash .gpu/dev/dev.sh install         the serving "image" (host torch + wheels), the operator package, crun
#   bash .gpu/dev/dev.sh smoke NAME      crun + captured spec + GPU check in the vllm container of pod NAME
#   bash .gpu/dev/dev.sh bench ARGS...   gpu_bench.py --runtime crun ARGS
set -u -o pipefail
K=/root/kvstash
IMG=/opt/kvimage
G=$PWD/.gpu
export PYTHONUNBUFFERED=1
case "$1" in
stash)
  mkdir -p $K && mv $PWD/.gpup$2/site.part* $K/ && ls -la $K && df -h /root /var/tmp | tail -2 ;;
install)
  t0=$(date +%s)
  mv $G/site.part* $K/ 2>/dev/null
  rm -rf $IMG && mkdir -p $IMG/serving/site $IMG/serving/bin $IMG/operator/site $IMG/operator/bin $IMG/crun
  cat $K/site.part* | xz -dc -T0 | tar -x -C $IMG/serving/site || exit 1
  rm -rf $IMG/serving/site/bin
  cp -r $G/operator/kvoffload $IMG/operator/site/
  cp -r $G/crun/. $IMG/crun/
  printf '#!/bin/sh\nLD_LIBRARY_PATH=%s/crun/lib exec %s/crun/crun "$@"\n' $IMG $IMG > $IMG/crun/run && chmod 755 $IMG/crun/run
  python3 $G/dev/shims.py $IMG "$(command -v python3)" || exit 1
  python3 -m compileall -q -j 0 $IMG/serving/site $IMG/operator/site >/dev/null 2>&1
  chmod -R a+rX $IMG
  $IMG/crun/run --version | head -2
  python3 -c "import torch; torch.cuda.init(); print('host torch', torch.__version__, torch.cuda.get_device_name(0))"
  ls -la /dev/nvidia* ; grep -c . /proc/self/mountinfo; cat /sys/fs/cgroup/cgroup.controllers; ulimit -Hn
  echo "install took $(( $(date +%s) - t0 )) s" ;;
smoke)
  cd $G/bench && python3 gpu_pod.py smoke --rendered $G/rendered/$2.yaml --oci-template $G/oci/hardened/c.json --crun $IMG/crun/run --out /tmp/smoke-$2 ;;
bench)
  shift
  for id in $($IMG/crun/run --root /run/kvbench-crun list -q 2>/dev/null); do $IMG/crun/run --root /run/kvbench-crun delete -f $id; done
  cd $G/bench && PYTHONPATH=$G/operator python3 gpu_bench.py --runtime crun --crun $IMG/crun/run --no-smoke --no-probe \
      --work /var/tmp/kvpod --disk-root /var/tmp/kvdisk --oci-template $G/oci/hardened/c.json --keep-volume home "$@" ;;
esac
