#!/usr/bin/env bash
# Builds the test guest image (see guest_image.rs, which runs this script and hashes its text
# into the cache key: any edit here means a rebuild).
#
#   guest_image.sh build SUITE PACKAGES ROOTFS_DIR OUT_DIR [MIRROR...]
#
# ROOTFS_DIR (must not exist) is scratch space for the root tree; OUT_DIR receives vmlinuz,
# initrd.img, rootfs.ext4 (raw ext4, root=/dev/vda) and packages.txt. The `essential` and
# `customize` subcommands are mmdebstrap hooks calling back into this file.
set -euo pipefail

self=$(readlink -f "$0")

# What the initramfs loads: enough to mount an ext4 root on a virtio disk. Everything else is
# loaded from the root filesystem by udev once it is mounted.
INITRAMFS_MODULES=(virtio_pci virtio_blk crc32c_generic ext4)

# Modules (under /usr/lib/modules/VERSION/kernel) for hardware a QEMU guest with virtio disks and
# NIC never uses. Removing them shrinks the image by about 250 MB, and udev no longer spends
# boot time under TCG loading drivers for the emulated floppy, IDE and CPU (kvm_amd, cpufreq).
# drivers/net is trimmed to virtio_net and a few virtual devices below.
UNNEEDED_MODULES=(sound drivers/gpu drivers/media drivers/infiniband drivers/usb drivers/iio
    drivers/staging drivers/hwmon drivers/hid drivers/md drivers/platform drivers/comedi
    drivers/bluetooth drivers/isdn drivers/mtd drivers/thunderbolt drivers/input drivers/video
    drivers/net/wireless drivers/net/ethernet drivers/target drivers/mmc drivers/nvme
    drivers/firewire drivers/edac drivers/crypto drivers/leds drivers/power drivers/mfd
    drivers/spi drivers/i2c drivers/gpio drivers/pinctrl drivers/memstick drivers/w1
    drivers/ata drivers/scsi drivers/block/floppy.ko drivers/cpufreq drivers/char/ipmi
    drivers/watchdog drivers/misc drivers/firmware drivers/parport drivers/pcmcia
    arch/x86/kvm net/wireless net/mac80211 net/bluetooth
    fs/btrfs fs/xfs fs/ocfs2 fs/gfs2 fs/nfs fs/nfsd fs/cifs fs/smb fs/ceph fs/f2fs fs/ubifs
    fs/jfs fs/reiserfs fs/nilfs2 fs/ntfs3 fs/dlm fs/bcachefs fs/erofs fs/afs fs/orangefs)

build() {
    local suite=$1 packages=$2 rootfs=$3 out=$4
    shift 4
    # minbase: no apt recommends, no docs, man pages or translations (dpkg path-exclude).
    mmdebstrap --variant=minbase --include="$packages" \
        --aptopt='Acquire::Check-Valid-Until "false"' \
        --dpkgopt='path-exclude=/usr/share/doc/*' \
        --dpkgopt='path-exclude=/usr/share/man/*' \
        --dpkgopt='path-exclude=/usr/share/info/*' \
        --dpkgopt='path-exclude=/usr/share/locale/*' \
        --dpkgopt='path-include=/usr/share/locale/locale.alias' \
        --essential-hook="bash '$self' essential \"\$1\"" \
        --customize-hook="bash '$self' customize \"\$1\" '$out'" \
        "$suite" "$rootfs" "$@"

    # Size: the tree plus headroom for logs and cloud-init's state; inodes to match, since
    # the tree is many small files. The image file is sparse.
    local used_mib files
    used_mib=$(du -s --block-size=1M "$rootfs" | cut -f1)
    files=$(find "$rootfs" -xdev | wc -l)
    mke2fs -q -F -t ext4 -L epo-guest -N $((files * 2 + 16384)) -d "$rootfs" \
        "$out/rootfs.ext4" "$((used_mib * 3 / 2 + 512))M"
}

# After the essential packages, before the kernel: the initramfs holds only the modules listed
# (the default, MODULES=most, packs hundreds and takes a minute to compress).
essential() {
    local root=$1
    mkdir -p "$root/etc/initramfs-tools/conf.d" "$root/usr/share/initramfs-tools/modules.d"
    echo 'MODULES=list' > "$root/etc/initramfs-tools/conf.d/epo-guest.conf"
    printf '%s\n' "${INITRAMFS_MODULES[@]}" > "$root/usr/share/initramfs-tools/modules.d/epo-guest"
}

customize() {
    local root=$1 out=$2

    # The root filesystem is the whole virtio disk; no fsck at boot (every boot is a fresh
    # overlay of an image that was never mounted).
    echo '/dev/vda / ext4 rw,errors=remount-ro 0 0' > "$root/etc/fstab"

    echo 'epo-guest' > "$root/etc/hostname"
    printf '127.0.0.1\tlocalhost\n127.0.1.1\tepo-guest\n' > "$root/etc/hosts"

    # The NIC takes DHCP (QEMU's user-mode network gives 10.0.2.15). It is eth0 in whichever PCI
    # slot it sits: the kernel's name is kept (no predictable names, whatever the command line).
    # The image owns the network config, so cloud-init's is off.
    mkdir -p "$root/etc/systemd/network"
    ln -sf /dev/null "$root/etc/systemd/network/99-default.link"
    cat > "$root/etc/network/interfaces" <<'EOF'
auto lo
iface lo inet loopback

auto eth0
iface eth0 inet dhcp
EOF
    # Only the modules a proxy guest can use: Squid waits for the init stage, and under TCG
    # every module costs (the ssh module alone tries four ssh-keygen runs; there is no sshd).
    cat > "$root/etc/cloud/cloud.cfg.d/90_epo_guest.cfg" <<'EOF'
# The seed is a NoCloud ISO labelled cidata; nothing else is probed (no network metadata
# services: probing them under TCG costs minutes).
datasource_list: [ NoCloud, None ]
network: {config: disabled}
cloud_init_modules:
 - seed_random
 - bootcmd
 - write-files
 - set_hostname
 - update_hostname
 - update_etc_hosts
 - users-groups
cloud_config_modules:
 - timezone
 - runcmd
cloud_final_modules:
 - write-files-deferred
 - scripts-vendor
 - scripts-per-once
 - scripts-per-boot
 - scripts-per-instance
 - scripts-user
 - final-message
 - power-state-change
EOF

    # Squid reads the squid.conf that cloud-init writes (write_files runs in cloud-init.service).
    # squid.service is already ordered after it through network-online.target; this makes it
    # explicit and independent of what pulls network-online.target in.
    mkdir -p "$root/etc/systemd/system/squid.service.d"
    cat > "$root/etc/systemd/system/squid.service.d/epo-after-cloud-init.conf" <<'EOF'
[Unit]
After=cloud-init.service
EOF

    # Kernel and initramfs for direct kernel boot, then out of the root filesystem.
    local kver
    kver=$(basename "$(ls -d "$root"/usr/lib/modules/*)")
    cp "$root/boot/vmlinuz-$kver" "$out/vmlinuz"
    cp "$root/boot/initrd.img-$kver" "$out/initrd.img"
    rm -f "$root"/boot/vmlinuz-* "$root"/boot/initrd.img-* "$root"/boot/System.map-* \
        "$root"/vmlinuz "$root"/vmlinuz.old "$root"/initrd.img "$root"/initrd.img.old

    local modules=$root/usr/lib/modules/$kver/kernel
    for folder in "${UNNEEDED_MODULES[@]}"; do
        rm -rf "${modules:?}/$folder" "${modules:?}/$folder".*
    done
    find "$modules/drivers/net" -type f ! -name 'virtio_net.ko*' ! -name 'net_failover.ko*' \
        ! -name 'tun.ko*' ! -name 'veth.ko*' ! -name 'dummy.ko*' -delete
    chroot "$root" depmod -a "$kver"

    chroot "$root" dpkg-query -W -f='${Package} ${Version}\n' > "$out/packages.txt"
}

command=$1
shift
case "$command" in
    build) build "$@" ;;
    essential) essential "$@" ;;
    customize) customize "$@" ;;
    *) echo "unknown command $command" >&2; exit 2 ;;
esac
