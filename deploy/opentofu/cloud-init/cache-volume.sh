#!/bin/sh
# Mount the cache's persistence volume at the engine's data directory: wait for the disk (Nova attaches it after
# the instance boots), make a filesystem only if it has none (a replaced instance keeps the data), mount it via
# fstab (nofail: the instance still boots without it; the engine's RequiresMountsFor= then keeps it stopped).
# Usage: cache-volume.sh VOLUME_ID DATA_DIR OWNER
set -eu
volume_id="$1"
data_dir="$2"
owner="$3"
short=$(printf '%s' "$volume_id" | cut -c1-20)
device=""
tries=0
while [ -z "$device" ]; do
  for candidate in /dev/disk/by-id/*"$short"*; do
    if [ -b "$candidate" ]; then
      device="$candidate"
      break
    fi
  done
  if [ -z "$device" ]; then
    tries=$((tries + 1))
    if [ "$tries" -gt 300 ]; then
      echo "offload-cache-volume: volume $volume_id did not appear in /dev/disk/by-id" >&2
      exit 1
    fi
    sleep 2
  fi
done
if ! blkid -p "$device" >/dev/null 2>&1; then
  mkfs.ext4 -q -L offload-cache "$device"
fi
uuid=$(blkid -s UUID -o value "$device")
mkdir -p "$data_dir"
if ! grep -q "^UUID=$uuid " /etc/fstab; then
  echo "UUID=$uuid $data_dir ext4 defaults,nofail,x-systemd.device-timeout=120 0 2" >>/etc/fstab
fi
systemctl daemon-reload
mountpoint -q "$data_dir" || mount "$data_dir"
chown "$owner:$owner" "$data_dir"
chmod 0750 "$data_dir"
