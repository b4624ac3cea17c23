# Sourced by the GPU recipes that carry Python packages to the device machine (Python 3.12, x86-64, no registry
# there): pip downloads here, then the wheels the machine lacks are copied into a carried folder.
#   wheels_download DIR SPEC...           SPECs and all their needs as py3.12 manylinux (or pure) wheels into DIR
#   wheel_names FILE...                   each wheel's project name, normalised (lower case, '_' for '-')
#   wheels_copy_except DEST NAMES FILE... the FILEs whose project is not among NAMES (space-separated) into DEST
wheels_download() {
  local dir=$1
  shift
  mkdir -p "$dir" && python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
    --platform manylinux_2_5_x86_64 --platform any -d "$dir" "$@"
}
wheel_names() {
  local f
  for f in "$@"; do basename "$f" | sed 's/-[0-9].*//' | tr 'A-Z-' 'a-z_'; done
}
wheels_copy_except() {
  local dest=$1 names
  names=" $(echo "$2" | tr -s ' \n' '  ') "
  shift 2
  local f
  for f in "$@"; do
    case "$names" in *" $(wheel_names "$f") "*) ;; *) cp "$f" "$dest/" ;; esac
  done
}
