#ifndef KEYBAGFS_CFUSE_SHIM_H
#define KEYBAGFS_CFUSE_SHIM_H
#define FUSE_USE_VERSION 314
#include <fuse_lowlevel.h>
#include <sys/xattr.h>

/* Macros Swift does not import, re-exported as constants. */
static const int kbfs_XATTR_CREATE = XATTR_CREATE;
static const int kbfs_XATTR_REPLACE = XATTR_REPLACE;
#endif
