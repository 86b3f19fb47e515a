#ifndef KEYBAGFS_CFUSE_SHIM_H
#define KEYBAGFS_CFUSE_SHIM_H
#define FUSE_USE_VERSION 314
#include <fuse_lowlevel.h>
#include <sys/xattr.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/file.h>
#include <fcntl.h>
#include <linux/fs.h>

/// UTIME_* and friends are macros Swift does not import.
static const long kbfs_UTIME_NOW = UTIME_NOW;
static const long kbfs_UTIME_OMIT = UTIME_OMIT;
static const int kbfs_RENAME_NOREPLACE = RENAME_NOREPLACE;
static const int kbfs_RENAME_EXCHANGE = RENAME_EXCHANGE;
static const int kbfs_XATTR_CREATE = XATTR_CREATE;
static const int kbfs_XATTR_REPLACE = XATTR_REPLACE;
#endif
