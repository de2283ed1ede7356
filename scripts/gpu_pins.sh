# Sourced by the GPU scripts: `pin NAME` prints NAME's exact version in requirements/gpu.txt,
# the one list of GPU versions, and fails naming NAME when the list does not pin it with ==.
GPU_REQUIREMENTS=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/requirements/gpu.txt
pin() {
  local version
  version=$(sed -n "s/^$1==\([^ ;#]*\).*/\1/p" "$GPU_REQUIREMENTS")
  [[ -n $version ]] || { echo "$GPU_REQUIREMENTS pins no $1==VERSION" >&2; return 2; }
  echo "$version"
}
